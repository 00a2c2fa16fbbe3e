//! Chat templates rendered in worker processes with capped memory.
//!
//! A template is code inside the model file, and minijinja bounds its instructions, recursion and
//! output but not its intermediate values: `{% set s = s ~ s %}` forty times asks for a terabyte,
//! and an allocation failure aborts the process (Rust cannot recover from one). So a program that
//! renders templates from untrusted files (the `cmf` binary) re-executes itself in a worker mode
//! ([`serve_stdio`]), and every render of the process goes to such a worker, whose address space
//! is capped (`RLIMIT_AS`): a runaway template kills the worker only and the render fails with
//! [`LlmError::TemplateMemory`]. The next render starts a fresh worker.
//!
//! [`install`] switches the whole process over, once, at start-up; [`ChatTemplate`]'s render
//! methods then use the installed workers without their callers changing. Without it (tests,
//! embedders) templates render in the calling thread. A [`RenderWorkers`] can also be used
//! directly.
//!
//! Workers are long-lived (one request at a time each, over their stdin/stdout), started on
//! demand up to [`WorkerSettings::max_workers`]; a render waits for a free one beyond that. A
//! worker past the template's time limit (plus [`START_GRACE`]) is killed.

mod child;
mod process;
mod wire;

pub use child::serve_stdio;

use std::borrow::Cow;
use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::Duration;

use minijinja::Value;

use super::ChatTemplate;
use crate::error::{LlmError, Result};
use process::{Outcome, WorkerProcess};
use wire::{Reply, Request};

/// Address space of a worker by default: far more than a real template needs (a few MB), far
/// less than a machine running a model has.
pub const DEFAULT_MEMORY_LIMIT: u64 = 1 << 30;

/// Time a render may take beyond the template's own limit before its worker is killed: starting
/// a worker and compiling the template count against the deadline too.
pub const START_GRACE: Duration = Duration::from_secs(2);

#[derive(Debug, Clone)]
pub struct WorkerSettings {
    /// The executable to start, and the arguments that make it call [`serve_stdio`].
    pub program: PathBuf,
    pub args: Vec<OsString>,
    /// Bytes of address space per worker (`RLIMIT_AS`).
    pub memory_limit: u64,
    /// Workers alive at once (the renders that can run in parallel).
    pub max_workers: usize,
}

impl WorkerSettings {
    pub fn new(
        program: impl Into<PathBuf>,
        args: impl IntoIterator<Item = impl Into<OsString>>,
    ) -> WorkerSettings {
        WorkerSettings {
            program: program.into(),
            args: args.into_iter().map(Into::into).collect(),
            memory_limit: DEFAULT_MEMORY_LIMIT,
            max_workers: 4,
        }
    }
}

static INSTALLED: OnceLock<RenderWorkers> = OnceLock::new();

/// Sends every template render of this process to workers started with `settings` from now on.
/// Returns false (and changes nothing) if workers were already installed.
pub fn install(settings: WorkerSettings) -> bool {
    INSTALLED.set(RenderWorkers::new(settings)).is_ok()
}

/// The process's workers, if [`install`] was called.
pub fn installed() -> Option<&'static RenderWorkers> {
    INSTALLED.get()
}

/// A bounded pool of render workers.
pub struct RenderWorkers {
    settings: WorkerSettings,
    pool: Mutex<Pool>,
    returned: Condvar,
}

struct Pool {
    idle: Vec<WorkerProcess>,
    /// Workers alive or being started, idle ones included.
    live: usize,
}

impl RenderWorkers {
    pub fn new(settings: WorkerSettings) -> RenderWorkers {
        RenderWorkers {
            settings: WorkerSettings {
                max_workers: settings.max_workers.max(1),
                ..settings
            },
            pool: Mutex::new(Pool {
                idle: Vec::new(),
                live: 0,
            }),
            returned: Condvar::new(),
        }
    }

    pub fn settings(&self) -> &WorkerSettings {
        &self.settings
    }

    /// Process ids of the idle workers (for diagnostics and tests).
    pub fn idle_pids(&self) -> Vec<u32> {
        self.lock().idle.iter().map(WorkerProcess::id).collect()
    }

    /// [`ChatTemplate::render_with_kwargs`] in a worker.
    pub fn render(
        &self,
        template: &ChatTemplate,
        messages: Value,
        tools: Option<Value>,
        kwargs: &[(String, Value)],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let request = encode_request(
            template,
            &messages,
            tools.as_ref(),
            kwargs,
            add_generation_prompt,
        )?;
        let worker = self.send(&request)?;
        let (outcome, worker) = worker.wait_reply(template.limits().time + START_GRACE);
        self.give_back(worker);
        let limits = template.limits();
        match outcome {
            Outcome::Reply(Reply::Rendered(text)) => Ok(text),
            Outcome::Reply(Reply::Template(m)) => Err(LlmError::Template(m)),
            Outcome::Reply(Reply::Limit(m)) => Err(LlmError::TemplateLimit(m)),
            Outcome::Died(d) if d.out_of_memory() => Err(LlmError::TemplateMemory {
                origin: template.origin().map(str::to_string),
                limit_mib: self.settings.memory_limit >> 20,
            }),
            Outcome::Died(d) => Err(LlmError::TemplateLimit(d.describe())),
            Outcome::TimedOut => Err(LlmError::TemplateLimit(format!(
                "template limit: time limit exceeded ({:?}; the render worker was stopped)",
                limits.time
            ))),
        }
    }

    /// A worker that has taken `request`: an idle one, else a new one. A worker that ended while
    /// idle (killed from outside) is replaced, once.
    fn send(&self, request: &[u8]) -> Result<WorkerProcess> {
        let mut worker = self.take()?;
        let mut tries = 0;
        loop {
            tries += 1;
            let sent = !worker.has_exited() && worker.send(request).is_ok();
            if sent {
                return Ok(worker);
            }
            if tries == 2 {
                drop(worker);
                self.give_back(None);
                return Err(LlmError::Other(format!(
                    "chat template render worker ({}) ended before taking a request",
                    self.settings.program.display()
                )));
            }
            drop(worker);
            worker = match self.start() {
                Ok(w) => w,
                Err(e) => {
                    self.give_back(None);
                    return Err(e);
                }
            };
        }
    }

    /// An idle worker, or a new one while fewer than `max_workers` are alive; otherwise waits.
    fn take(&self) -> Result<WorkerProcess> {
        let mut pool = self.lock();
        loop {
            if let Some(w) = pool.idle.pop() {
                return Ok(w);
            }
            if pool.live < self.settings.max_workers {
                pool.live += 1;
                break;
            }
            pool = self.returned.wait(pool).unwrap_or_else(|e| e.into_inner());
        }
        drop(pool);
        self.start().inspect_err(|_| self.give_back(None))
    }

    fn start(&self) -> Result<WorkerProcess> {
        WorkerProcess::spawn(&self.settings).map_err(|e| {
            LlmError::Other(format!(
                "cannot start the chat template render worker ({}): {e}",
                self.settings.program.display()
            ))
        })
    }

    /// Returns a worker to the pool (`None`: it is gone, a new one may start).
    fn give_back(&self, worker: Option<WorkerProcess>) {
        let mut pool = self.lock();
        match worker {
            Some(w) => pool.idle.push(w),
            None => pool.live -= 1,
        }
        drop(pool);
        self.returned.notify_one();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pool> {
        self.pool.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn encode_request(
    template: &ChatTemplate,
    messages: &Value,
    tools: Option<&Value>,
    kwargs: &[(String, Value)],
    add_generation_prompt: bool,
) -> Result<Vec<u8>> {
    let tokens = |v: &Value| -> Result<Vec<wire::Token>> {
        let mut t = Vec::new();
        wire::encode(v, &mut t).map_err(LlmError::Template)?;
        Ok(t)
    };
    let request = Request {
        source: Cow::Borrowed(template.source()),
        special: Cow::Borrowed(template.special()),
        limits: template.limits(),
        messages: tokens(messages)?,
        tools: tools.map(tokens).transpose()?,
        kwargs: kwargs
            .iter()
            .map(|(k, v)| Ok((k.clone(), tokens(v)?)))
            .collect::<Result<_>>()?,
        add_generation_prompt,
    };
    serde_json::to_vec(&request).map_err(|e| LlmError::Other(format!("render request: {e}")))
}
