//! The second process: this test binary started again (`second_process`, with
//! [`ENV_HOG`] set), on cmf-gpu's own CUDA runtime. `compute` enqueues 8192² SGEMMs back to back
//! (each one a long kernel that keeps the card busy); `memory` allocates every free byte it can
//! and holds it. It prints [`READY`] once the card is loaded, and stops after [`HOG_SECONDS`]
//! or when the test kills it, whichever comes first.

use cmf_gpu::cuda::runtime::blas::Blas;
use cmf_gpu::cuda::runtime::device::Dev;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// `compute` or `memory`: set, the `second_process` test acts as the hog.
const ENV_HOG: &str = "CMF_TEST_GPU_HOG";
const READY: &str = "HOG READY";
const FAILED: &str = "HOG FAILED";
/// A hog never outlives this, even if its test died without killing it.
const HOG_SECONDS: u64 = 120;
/// How long the test waits for the hog to load the card (context, cuBLAS, first GEMMs).
const START_TIMEOUT: Duration = Duration::from_secs(120);
const GEMM_N: usize = 8192;

#[derive(Clone, Copy, Debug)]
pub enum Mode {
    Compute,
    Memory,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Compute => "compute",
            Mode::Memory => "memory",
        }
    }
}

/// The running hog; dropping it ends the process.
pub struct Hog {
    child: Child,
}

impl Drop for Hog {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Hog {
    /// Starts the hog and waits until it has loaded the card. None (with `SKIPPED: …` printed)
    /// when it cannot: the card refuses a second process (exclusive compute mode) or the hog
    /// could not get a device.
    pub fn start(mode: Mode) -> Option<Hog> {
        let exe = std::env::current_exe().expect("the test binary's path");
        let child = Command::new(exe)
            .args([
                "second_process",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ENV_HOG, mode.name())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting the second process");
        let mut hog = Hog { child };
        let stdout = hog.child.stdout.take().expect("piped");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            // The harness may print "test second_process ... " before the report on its line.
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(at) = line.find(READY).or_else(|| line.find(FAILED)) {
                    let _ = tx.send(line[at..].to_string());
                }
            }
        });
        match rx.recv_timeout(START_TIMEOUT) {
            Ok(line) if line.starts_with(READY) => {
                println!("second process ({}): {line}", mode.name());
                Some(hog)
            }
            Ok(line) => {
                crate::skip_unsupported(&format!(
                    "the second process could not load the card: {line}"
                ));
                None
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                panic!("the second process did not load the card within {START_TIMEOUT:?}")
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let status = hog.child.wait();
                panic!("the second process ended without a report ({status:?})")
            }
        }
    }
}

/// The body of the `second_process` test: nothing unless [`ENV_HOG`] names a mode.
pub fn main_if_asked() {
    let mode = match std::env::var(ENV_HOG).as_deref() {
        Ok("compute") => Mode::Compute,
        Ok("memory") => Mode::Memory,
        _ => return,
    };
    let deadline = Instant::now() + Duration::from_secs(HOG_SECONDS);
    if let Err(e) = hog(mode, deadline) {
        say(&format!("{FAILED}: {e}"));
    }
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn hog(mode: Mode, deadline: Instant) -> Result<(), String> {
    let dev = Dev::open(0)?;
    match mode {
        Mode::Compute => {
            let blas = Blas::new(&dev).map_err(|e| e.to_string())?;
            let bytes = GEMM_N * GEMM_N * 4;
            let buf = |_| dev.alloc_zeroed(bytes).map_err(|e| e.to_string());
            let [a, b, c] = [buf(0)?, buf(1)?, buf(2)?];
            let mut ready = false;
            while Instant::now() < deadline {
                // A few kernels queued at a time: the card never idles between syncs.
                let t0 = Instant::now();
                for _ in 0..4 {
                    blas.gemm(
                        false,
                        a.ptr(),
                        b.ptr(),
                        c.ptr(),
                        GEMM_N,
                        GEMM_N,
                        GEMM_N,
                        GEMM_N,
                        false,
                    )
                    .map_err(|e| e.to_string())?;
                }
                dev.sync().map_err(|e| e.to_string())?;
                if !ready {
                    ready = true;
                    say(&format!(
                        "{READY}: {GEMM_N}² SGEMMs back to back, {:.1} ms each",
                        t0.elapsed().as_secs_f64() * 1e3 / 4.0
                    ));
                }
            }
        }
        Mode::Memory => {
            let mut held = Vec::new();
            let mut chunk = 1usize << 30;
            while chunk >= 1 << 20 {
                match dev.alloc(chunk) {
                    Ok(b) => held.push(b),
                    Err(_) => chunk /= 2,
                }
            }
            dev.sync().map_err(|e| e.to_string())?;
            let total: usize = held.iter().map(|b| b.len()).sum();
            say(&format!(
                "{READY}: holding {} MiB of device memory, {} MiB left free",
                total >> 20,
                dev.free_bytes() >> 20
            ));
            while Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
    Ok(())
}
