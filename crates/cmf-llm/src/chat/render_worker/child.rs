//! The worker's side: read the [`Hello`], cap the process's address space, then answer render
//! requests until the parent closes the pipe. Renders run in this process, under the template's
//! own [`Limits`](crate::chat::template::Limits); an allocation past the cap aborts this process
//! only, and the parent reads the allocator's message from its stderr.

use std::io::{self, Read, Write};
use std::panic::{catch_unwind, AssertUnwindSafe};

use super::wire::{self, Hello, Reply, Request};
use crate::chat::template::{ChatTemplate, Limits, SpecialTokens};
use crate::error::LlmError;

/// Serves render requests on stdin/stdout until stdin ends. For the hidden worker mode of a
/// binary that enables [`super::install`]; returns an error for a malformed stream.
pub fn serve_stdio() -> io::Result<()> {
    // A panic is caught and answered as an error; the default report would only fill the
    // stderr pipe, which the parent reads after the worker ends.
    std::panic::set_hook(Box::new(|_| {}));
    serve(&mut io::stdin().lock(), &mut io::stdout().lock())
}

fn serve(input: &mut impl Read, output: &mut impl Write) -> io::Result<()> {
    let hello = wire::read_frame(input, 1 << 16)?
        .ok_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, "no set-up frame"))?;
    let hello: Hello = serde_json::from_slice(&hello).map_err(io::Error::other)?;
    limit_address_space(hello.memory_limit)?;
    let mut compiled: Option<Compiled> = None;
    while let Some(frame) = wire::read_frame(input, hello.memory_limit)? {
        let reply = catch_unwind(AssertUnwindSafe(|| answer(&frame, &mut compiled)))
            .unwrap_or_else(|p| {
                compiled = None;
                Reply::Template(format!("the render panicked: {}", panic_text(&*p)))
            });
        reply.write(output)?;
    }
    Ok(())
}

/// The last template compiled, kept for the next request (a process serves one model).
struct Compiled {
    source: String,
    special: SpecialTokens,
    limits: Limits,
    template: ChatTemplate,
}

fn answer(frame: &[u8], compiled: &mut Option<Compiled>) -> Reply {
    let req: Request = match serde_json::from_slice(frame) {
        Ok(r) => r,
        Err(e) => return Reply::Template(format!("malformed render request: {e}")),
    };
    let same = compiled.as_ref().is_some_and(|c| {
        c.source == req.source && c.special == *req.special && c.limits == req.limits
    });
    if !same {
        *compiled = None;
        match ChatTemplate::with_limits(&req.source, req.special.clone().into_owned(), req.limits) {
            Ok(template) => {
                *compiled = Some(Compiled {
                    source: req.source.into_owned(),
                    special: req.special.into_owned(),
                    limits: req.limits,
                    template,
                })
            }
            Err(e) => return reply_of(e),
        }
    }
    let Some(c) = compiled.as_ref() else {
        return Reply::Template("no template".into());
    };
    let values = (|| -> Result<_, String> {
        let messages = wire::decode(req.messages)?;
        let tools = req.tools.map(wire::decode).transpose()?;
        let kwargs = req
            .kwargs
            .into_iter()
            .map(|(k, v)| Ok((k, wire::decode(v)?)))
            .collect::<Result<Vec<_>, String>>()?;
        Ok((messages, tools, kwargs))
    })();
    match values {
        Ok((messages, tools, kwargs)) => {
            match c
                .template
                .render_here(messages, tools, &kwargs, req.add_generation_prompt)
            {
                Ok(text) => Reply::Rendered(text),
                Err(e) => reply_of(e),
            }
        }
        Err(e) => Reply::Template(format!("malformed render request: {e}")),
    }
}

/// The error's text without the `chat template: ` prefix the parent adds back.
fn reply_of(e: LlmError) -> Reply {
    match e {
        LlmError::TemplateLimit(m) => Reply::Limit(m),
        LlmError::Template(m) => Reply::Template(m),
        other => Reply::Template(other.to_string()),
    }
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> &str {
    p.downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| p.downcast_ref::<&str>().copied())
        .unwrap_or("no message")
}

/// Caps the address space (`RLIMIT_AS`): past it every allocation fails, and Rust's allocation
/// failure aborts this process with a message on stderr. No core file: dumping a gigabyte would
/// delay the parent's answer and litter the working directory.
#[cfg(unix)]
fn limit_address_space(bytes: u64) -> io::Result<()> {
    for (resource, value) in [(libc::RLIMIT_CORE, 0), (libc::RLIMIT_AS, bytes)] {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes into the struct we pass.
        if unsafe { libc::getrlimit(resource, &mut lim) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // Never above the hard limit: raising it is not permitted.
        let value = (value as libc::rlim_t).min(lim.rlim_max);
        lim.rlim_cur = value;
        lim.rlim_max = value;
        // SAFETY: setrlimit only reads the struct we pass.
        if unsafe { libc::setrlimit(resource, &lim) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(not(unix))]
fn limit_address_space(_bytes: u64) -> io::Result<()> {
    Err(io::Error::other(
        "render workers need a Unix system (setrlimit)",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use minijinja::Value;

    fn request(source: &str, content: &str) -> Vec<u8> {
        let mut messages = Vec::new();
        let msgs = Value::from(vec![Value::from_iter([("content", content)])]);
        wire::encode(&msgs, &mut messages).unwrap();
        let req = Request {
            source: source.into(),
            special: std::borrow::Cow::Owned(SpecialTokens::default()),
            limits: Limits::default(),
            messages,
            tools: None,
            kwargs: vec![("x".into(), vec![wire::Token::Int(7)])],
            add_generation_prompt: true,
        };
        serde_json::to_vec(&req).unwrap()
    }

    /// Requests through `serve` on in-memory pipes (the memory cap is left out: it would apply to
    /// the test process).
    #[test]
    fn answers_each_request_in_order() {
        let mut compiled = None;
        let src = "{{ messages[0].content }}{{ x }}{% if add_generation_prompt %}!{% endif %}";
        assert_eq!(
            answer(&request(src, "hi"), &mut compiled),
            Reply::Rendered("hi7!".into())
        );
        assert_eq!(
            answer(&request(src, "yo"), &mut compiled),
            Reply::Rendered("yo7!".into())
        );
        let e = answer(&request("{{ raise_exception('no') }}", "a"), &mut compiled);
        assert!(
            matches!(&e, Reply::Template(m) if m.contains("no")),
            "{e:?}"
        );
        let e = answer(
            &request(
                "{% for i in range(100000) %}{{ 'x' * 1000000 }}{% endfor %}",
                "a",
            ),
            &mut compiled,
        );
        assert!(
            matches!(&e, Reply::Limit(m) if m.contains("output size")),
            "{e:?}"
        );
        let e = answer(&request("{% for %}", "a"), &mut compiled);
        assert!(matches!(&e, Reply::Template(_)), "{e:?}");
        let e = answer(b"not json", &mut compiled);
        assert!(
            matches!(&e, Reply::Template(m) if m.contains("malformed")),
            "{e:?}"
        );
    }
}
