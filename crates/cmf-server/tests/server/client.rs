//! A minimal blocking HTTP/1.1 client over `std::net::TcpStream`, for loopback tests: whole
//! responses (Content-Length or chunked), and server-sent-event streams read event by event so
//! a test can hang up in the middle. Every socket has read and write timeouts.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

pub const IO_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "{e}: status {} body {:?}",
                self.status,
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

pub fn connect(addr: SocketAddr) -> TcpStream {
    assert!(addr.ip().is_loopback(), "tests talk to loopback only");
    let s = TcpStream::connect_timeout(&addr, Duration::from_secs(10)).expect("connect");
    s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    s.set_write_timeout(Some(IO_TIMEOUT)).unwrap();
    s
}

/// Sends one request (`Connection: close`); `extra` are added header lines.
pub fn send(
    s: &mut TcpStream,
    method: &str,
    path: &str,
    extra: &[(&str, &str)],
    body: Option<&[u8]>,
) {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n");
    for (k, v) in extra {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(b) = body {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        ));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    if let Some(b) = body {
        // The server may answer (413) and close before reading everything.
        let _ = s.write_all(b);
    }
}

pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    extra: &[(&str, &str)],
    body: Option<&[u8]>,
) -> Resp {
    let mut s = connect(addr);
    send(&mut s, method, path, extra, body);
    let mut r = BufReader::new(s);
    let (status, headers) = read_head(&mut r);
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let body = if chunked {
        let mut out = Vec::new();
        while let Some(c) = read_chunk(&mut r) {
            out.extend_from_slice(&c);
        }
        out
    } else {
        let mut out = Vec::new();
        r.read_to_end(&mut out).unwrap();
        out
    };
    Resp {
        status,
        headers,
        body,
    }
}

pub fn get(addr: SocketAddr, path: &str) -> Resp {
    request(addr, "GET", path, &[], None)
}

pub fn post(addr: SocketAddr, path: &str, body: &serde_json::Value) -> Resp {
    request(addr, "POST", path, &[], Some(body.to_string().as_bytes()))
}

fn read_head(r: &mut impl BufRead) -> (u16, Vec<(String, String)>) {
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .unwrap_or_else(|| panic!("bad status line {line:?}"))
        .parse()
        .unwrap();
    let mut headers = Vec::new();
    loop {
        line.clear();
        r.read_line(&mut line).unwrap();
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        let (k, v) = l.split_once(':').expect("header line");
        headers.push((k.trim().to_string(), v.trim().to_string()));
    }
    (status, headers)
}

/// One chunk of a chunked body; `None` at the terminating zero-size chunk or EOF.
fn read_chunk(r: &mut impl BufRead) -> Option<Vec<u8>> {
    let mut line = String::new();
    if r.read_line(&mut line).ok()? == 0 {
        return None;
    }
    let size = usize::from_str_radix(line.trim().split(';').next()?, 16).ok()?;
    if size == 0 {
        return None;
    }
    let mut data = vec![0; size + 2];
    r.read_exact(&mut data).ok()?;
    data.truncate(size);
    Some(data)
}

/// A server-sent-event response read one `data:` payload at a time.
pub struct EventStream {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    reader: BufReader<TcpStream>,
    pending: String,
}

impl EventStream {
    pub fn open(addr: SocketAddr, path: &str, body: &serde_json::Value) -> EventStream {
        let mut s = connect(addr);
        send(&mut s, "POST", path, &[], Some(body.to_string().as_bytes()));
        let mut reader = BufReader::new(s);
        let (status, headers) = read_head(&mut reader);
        EventStream {
            status,
            headers,
            reader,
            pending: String::new(),
        }
    }

    /// The next event's data (`[DONE]` included); `None` when the stream ends.
    pub fn next_data(&mut self) -> Option<String> {
        loop {
            if let Some(end) = self.pending.find("\n\n") {
                let event: String = self.pending.drain(..end + 2).collect();
                let data = event
                    .lines()
                    .filter_map(|l| l.strip_prefix("data: "))
                    .collect::<Vec<_>>()
                    .join("\n");
                return Some(data);
            }
            let chunk = read_chunk(&mut self.reader)?;
            self.pending
                .push_str(&String::from_utf8(chunk).expect("UTF-8 events"));
        }
    }

    /// Every remaining event's data.
    pub fn collect(mut self) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(d) = self.next_data() {
            out.push(d);
        }
        out
    }
}
