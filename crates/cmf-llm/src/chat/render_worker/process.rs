//! One worker process seen from the parent: spawn it, send a request, wait for the reply until a
//! deadline, and when it ends without one, tell from its exit and stderr why.

use std::io::Read;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::Duration;

use super::wire::{self, Hello, Reply};
use super::WorkerSettings;

pub struct WorkerProcess {
    child: Child,
    stdin: ChildStdin,
    replies: Receiver<std::io::Result<Reply>>,
}

/// How waiting for a reply ended.
pub enum Outcome {
    Reply(Reply),
    /// The worker ended (or broke the protocol) before answering; it has been reaped.
    Died(Death),
    /// No reply before the deadline; the worker has been killed.
    TimedOut,
}

pub struct Death {
    pub status: Option<ExitStatus>,
    /// The end of what the worker wrote to stderr (the allocator's message, a runtime abort).
    pub stderr: String,
    /// A protocol error, when that is why the worker was given up.
    pub protocol: Option<String>,
}

impl Death {
    /// Rust's allocation-failure report: the worker ran out of its address space.
    pub fn out_of_memory(&self) -> bool {
        self.stderr.contains("memory allocation of")
    }

    pub fn describe(&self) -> String {
        let how = match (&self.protocol, self.status) {
            (Some(p), _) => format!("broke the protocol ({p})"),
            (None, Some(s)) => format!("ended without an answer ({s})"),
            (None, None) => "ended without an answer".to_string(),
        };
        let said = self.stderr.trim();
        if said.is_empty() {
            format!("the render worker {how}")
        } else {
            format!("the render worker {how}: {said}")
        }
    }
}

/// What the parent keeps of a worker's stderr.
const STDERR_TAIL: u64 = 4096;

impl WorkerProcess {
    pub fn spawn(settings: &WorkerSettings) -> std::io::Result<WorkerProcess> {
        let mut cmd = Command::new(&settings.program);
        cmd.args(&settings.args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // Its own process group: Ctrl-C in a terminal goes to the parent, which decides; the
        // worker ends when the parent closes its stdin.
        #[cfg(unix)]
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let mut child = cmd.spawn()?;
        let (Some(mut stdin), Some(mut stdout)) = (child.stdin.take(), child.stdout.take()) else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(std::io::Error::other("the worker's pipes are missing"));
        };
        let hello = serde_json::to_vec(&Hello {
            memory_limit: settings.memory_limit,
        })
        .map_err(std::io::Error::other)?;
        if let Err(e) = wire::write_frame(&mut stdin, &hello) {
            let _ = child.kill();
            let _ = child.wait();
            return Err(e);
        }
        // Replies arrive through a thread so the parent can wait with a deadline; it ends when
        // the worker's stdout closes.
        let (tx, replies) = mpsc::channel();
        let max = settings.memory_limit;
        std::thread::Builder::new()
            .name("template-worker-reader".into())
            .spawn(move || loop {
                let reply = match wire::read_frame(&mut stdout, max) {
                    Ok(Some(frame)) => Reply::parse(frame),
                    Ok(None) => break,
                    Err(e) => Err(e),
                };
                let failed = reply.is_err();
                if tx.send(reply).is_err() || failed {
                    break;
                }
            })?;
        Ok(WorkerProcess {
            child,
            stdin,
            replies,
        })
    }

    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Whether the process has ended (killed while idle, say).
    pub fn has_exited(&mut self) -> bool {
        !matches!(self.child.try_wait(), Ok(None))
    }

    /// Sends one request; an error means the worker cannot take it (it has ended).
    pub fn send(&mut self, request: &[u8]) -> std::io::Result<()> {
        wire::write_frame(&mut self.stdin, request)
    }

    /// The reply to the request sent, within `deadline`.
    pub fn wait_reply(mut self, deadline: Duration) -> (Outcome, Option<WorkerProcess>) {
        match self.replies.recv_timeout(deadline) {
            Ok(Ok(reply)) => (Outcome::Reply(reply), Some(self)),
            Ok(Err(e)) => (Outcome::Died(self.reap(Some(e.to_string()))), None),
            Err(RecvTimeoutError::Disconnected) => (Outcome::Died(self.reap(None)), None),
            Err(RecvTimeoutError::Timeout) => {
                let _ = self.child.kill();
                let _ = self.child.wait();
                (Outcome::TimedOut, None)
            }
        }
    }

    /// Ends the process (if it still runs) and collects its status and the end of its stderr.
    fn reap(mut self, protocol: Option<String>) -> Death {
        if protocol.is_some() {
            let _ = self.child.kill();
        }
        let status = self.child.wait().ok();
        let mut stderr = Vec::new();
        if let Some(err) = self.child.stderr.take() {
            // The process is gone, so this read ends at the pipe's end; bounded all the same.
            let _ = err.take(STDERR_TAIL).read_to_end(&mut stderr);
        }
        Death {
            status,
            stderr: String::from_utf8_lossy(&stderr).into_owned(),
            protocol,
        }
    }
}

impl Drop for WorkerProcess {
    /// A worker given up (the pool dropped, a failed send) does not outlive its handle.
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
