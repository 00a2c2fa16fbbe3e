//! Errors as the OpenAI API returns them: an HTTP status and the body
//! `{"error": {"message", "type", "param", "code"}}`. `param` names the request field at fault
//! (`messages[1].role`, `temperature`) so a client can point at it.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, `server_error`, …
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400 for a field with a wrong type or value; the message is prefixed with the field name.
    pub fn field(param: impl Into<String>, msg: impl std::fmt::Display) -> ApiError {
        let param = param.into();
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: format!("`{param}`: {msg}"),
            kind: "invalid_request_error",
            param: Some(param),
            code: Some("invalid_value"),
        }
    }

    /// 400 for a request that cannot be served as asked (not tied to one field).
    pub fn bad_request(msg: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: msg.into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    pub fn with_code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    pub fn unauthorized() -> ApiError {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: "missing or invalid API key: send `Authorization: Bearer <key>`".into(),
            kind: "authentication_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    pub fn not_found(what: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: what.into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("not_found"),
        }
    }

    pub fn method_not_allowed() -> ApiError {
        ApiError {
            status: StatusCode::METHOD_NOT_ALLOWED,
            message: "method not allowed on this path".into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("method_not_allowed"),
        }
    }

    pub fn too_large(limit: usize) -> ApiError {
        ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!("request body larger than the limit of {limit} bytes"),
            kind: "invalid_request_error",
            param: None,
            code: Some("request_too_large"),
        }
    }

    /// 503: every queue slot is taken; the client should retry later.
    pub fn overloaded(capacity: usize) -> ApiError {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: format!(
                "the server is busy: {capacity} requests are already waiting; retry later"
            ),
            kind: "server_error",
            param: None,
            code: Some("queue_full"),
        }
    }

    pub fn internal(msg: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: msg.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    /// The JSON body (also sent as the last event of a stream that fails after it started).
    pub fn body(&self) -> serde_json::Value {
        #[derive(Serialize)]
        struct Inner<'a> {
            message: &'a str,
            #[serde(rename = "type")]
            kind: &'a str,
            param: Option<&'a str>,
            code: Option<&'a str>,
        }
        serde_json::json!({ "error": Inner {
            message: &self.message,
            kind: self.kind,
            param: self.param.as_deref(),
            code: self.code,
        }})
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

impl std::error::Error for ApiError {}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = crate::routes::json_response(self.status, &self.body());
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        resp
    }
}
