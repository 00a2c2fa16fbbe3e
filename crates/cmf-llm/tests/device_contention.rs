//! Another process on the card, as `cmf run` meets it: device operations slowed by time slicing
//! (the contention guard moves the rest of the process to the CPU) and device memory taken
//! (an allocation failure is a refusal, the CPU path runs). Either way a generation completes
//! and its ids equal the CPU's on the f32 fixture (greedy).
//!
//! On a CUDA machine the other process is this test binary started again as a [`hog`]: cuBLAS
//! SGEMMs in a loop, or every free byte of device memory held. Without a device those tests
//! print `SKIPPED: …`; the same scenarios then run on the fake backend, whose injected faults
//! (a delay per operation, a failing allocation) stand in for the other process.

mod common;
#[path = "device_contention/hog.rs"]
mod hog;

use cmf_gpu::facade::fake::{FakeBackend, FakeFaults};
use cmf_gpu::facade::{
    Gpu, GpuMode, LayerSet, RefusalReason, CONTENTION_FACTOR, CONTENTION_FLOOR, CONTENTION_STRIKES,
};
use cmf_gpu::llm::sample::SampleSpec;
use cmf_gpu::llm::LlmOptions;
use cmf_llm::chat::Tokenizer;
use cmf_llm::engine::{CpuEngine, Engine};
use cmf_llm::generate::{generate, GenerationConfig};
use cmf_llm::gpu::{describe, GpuEngine, GpuModel};
use cmf_llm::Model;
use common::*;
use hog::Hog;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const FIXTURE: &str = "llama-tiny";
const CONTEXT: usize = 256;
/// Generated tokens per run: one device operation each, so the guard has many chances to trip.
const TOKENS: usize = 120;

/// One scenario at a time: a second process (or an injected fault) must not slow another test.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// An engine whose calls are timed: the wall time of every call that may run on the device.
struct Timed<'e> {
    inner: &'e mut dyn Engine,
    took: Vec<Duration>,
}

impl Timed<'_> {
    fn time<T>(&mut self, call: impl FnOnce(&mut dyn Engine) -> T) -> T {
        let t0 = Instant::now();
        let v = call(&mut *self.inner);
        self.took.push(t0.elapsed());
        v
    }
}

impl Engine for Timed<'_> {
    fn prefill(&mut self, tokens: &[u32]) -> cmf_llm::Result<&[f32]> {
        let t0 = Instant::now();
        let r = self.inner.prefill(tokens);
        self.took.push(t0.elapsed());
        r
    }
    fn decode(&mut self, token: u32) -> cmf_llm::Result<&[f32]> {
        let t0 = Instant::now();
        let r = self.inner.decode(token);
        self.took.push(t0.elapsed());
        r
    }
    fn decode_sampled(&mut self, token: u32, spec: &SampleSpec) -> cmf_llm::Result<Option<u32>> {
        self.time(|e| e.decode_sampled(token, spec))
    }
    fn prefill_piece(&self) -> usize {
        self.inner.prefill_piece()
    }
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn limit(&self) -> usize {
        self.inner.limit()
    }
    fn truncate(&mut self, len: usize) {
        self.inner.truncate(len)
    }
}

/// Greedy generation as `cmf run` drives it; the ids and each engine call's time.
fn run(engine: &mut dyn Engine, tok: &Tokenizer, prompt: &[u32]) -> (Vec<u32>, Vec<Duration>) {
    let cfg = GenerationConfig {
        max_tokens: TOKENS,
        ..Default::default()
    };
    let mut timed = Timed {
        inner: engine,
        took: Vec::new(),
    };
    let mut history = Vec::new();
    generate(&mut timed, tok, prompt, &mut history, &cfg, &mut |_| {}).unwrap();
    (history, timed.took)
}

fn cpu_ids(model: &Model, tok: &Tokenizer, prompt: &[u32]) -> Vec<u32> {
    run(
        &mut CpuEngine::new(model, CONTEXT, cmf_kernels::KvDtype::F32).unwrap(),
        tok,
        prompt,
    )
    .0
}

fn device_engine<'m, 'a>(gpu: &Gpu, model: &'m Model<'a>) -> GpuEngine<'m, 'a> {
    let g = GpuModel::try_load(gpu, model, CONTEXT, None)
        .unwrap_or_else(|why| panic!("{FIXTURE} does not load on the device: {why}"));
    GpuEngine::new(model, g, CONTEXT, cmf_kernels::KvDtype::F32)
}

/// Longest run of calls over the guard's budget, judged against the fastest unloaded call.
fn longest_over_budget(best: Duration, took: &[Duration]) -> usize {
    let over = |t: &Duration| *t > best * CONTENTION_FACTOR && *t > best + CONTENTION_FLOOR;
    took.iter()
        .fold((0, 0), |(run, longest), t| {
            let run = if over(t) { run + 1 } else { 0 };
            (run, longest.max(run))
        })
        .1
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// What a generation under another process's load did.
struct Contention {
    /// The guard gave the device up for the rest of the process.
    tripped: bool,
    /// The engine left the device during the loaded generation.
    moved: bool,
    summary: String,
}

/// A generation on the device without load (it sets the guard's budgets), then another with
/// `load` started: both complete with the CPU's ids; a trip means the rest of the process runs
/// on the CPU, and without one the engine stayed on the device.
fn generation_under_load<L>(gpu: &Gpu, load: impl FnOnce() -> Option<L>) -> Option<Contention> {
    let mut outcome = None;
    with_fixture(FIXTURE, |model, tok, prompt| {
        let want = cpu_ids(model, tok, prompt);
        let mut dev = device_engine(gpu, model);
        let (got, quiet) = run(&mut dev, tok, prompt);
        assert_eq!(
            got, want,
            "{FIXTURE}: the device's ids differ from the CPU's"
        );
        if gpu.is_contended() {
            // This machine alone slowed the fake (or the card) past the budget: nothing left
            // to measure under load, but the ids were checked.
            skip_unsupported("the device was already contended before any load started");
            return;
        }
        assert!(dev.is_gpu(), "the device refused an unloaded generation");
        let Some(held) = load() else { return };
        let mut dev = device_engine(gpu, model);
        let (got, loaded) = run(&mut dev, tok, prompt);
        drop(held);
        assert_eq!(got, want, "{FIXTURE} under load: ids differ from the CPU's");
        let tripped = gpu.is_contended();
        let moved = !dev.is_gpu();
        // Skip the cold first call (prefill) when judging, as the guard does.
        let best = quiet[1..].iter().min().copied().unwrap_or_default();
        let median = |v: &[Duration]| {
            let mut v = v.to_vec();
            v.sort();
            v[v.len() / 2]
        };
        let summary = format!(
            "unloaded calls: best {:.2} ms, median {:.2} ms; loaded: median {:.2} ms, worst {:.2} ms, \
             longest run over {CONTENTION_FACTOR}x and +{} ms: {} (the guard trips at {CONTENTION_STRIKES}); \
             guard tripped: {tripped}, engine moved to the CPU mid-run: {moved}",
            ms(best),
            ms(median(&quiet[1..])),
            ms(median(&loaded)),
            ms(loaded.iter().max().copied().unwrap_or_default()),
            CONTENTION_FLOOR.as_millis(),
            longest_over_budget(best, &loaded),
        );
        if tripped {
            // The rest of the process: every entry point and every load refuse as contended.
            assert_eq!(
                gpu.check("llm.decode").unwrap_err().reason,
                RefusalReason::Contended
            );
            let why = GpuModel::try_load(gpu, model, CONTEXT, None)
                .err()
                .expect("a load after the trip refuses");
            assert!(why.contains("contended"), "{why}");
        } else {
            assert!(
                !moved,
                "the engine left the device without the guard tripping: {summary}"
            );
        }
        outcome = Some(Contention {
            tripped,
            moved,
            summary,
        });
    });
    outcome
}

/// What the memory scenario saw.
struct Memory {
    /// The resident model's run left the device when the memory went (an allocation failed).
    moved: bool,
    auto_refusal: String,
    explicit_refusal: String,
}

/// Device memory taken by someone else. With `take` holding it, loads refuse (automatic
/// placement, and user-placed layers: a real allocation that fails) and leave nothing
/// allocated, so `cmf run` takes the CPU path; once it is back the device loads and runs with
/// the CPU's ids. Then `take_while_running` takes it from under a resident model: the run
/// completes with the CPU's ids, on the device or moved to the CPU.
fn generation_without_memory<L, M>(
    gpu: &Gpu,
    take: impl FnOnce() -> Option<L>,
    take_while_running: impl FnOnce() -> Option<M>,
) -> Option<Memory> {
    let mut outcome = None;
    with_fixture(FIXTURE, |model, tok, prompt| {
        let want = cpu_ids(model, tok, prompt);
        let desc = describe(model, CONTEXT).unwrap();
        let opts = LlmOptions {
            max_context: CONTEXT,
            ..Default::default()
        };
        let n = model.config.num_layers;
        let all = LayerSet::parse(&format!("0-{}", n - 1), "--gpu-layers").unwrap();
        let resident = gpu.bytes_resident();
        let Some(held) = take() else { return };
        let auto = gpu.load_llm(&desc, &opts, None).unwrap_err();
        assert!(
            auto.reason.is_out_of_memory(),
            "automatic placement: {auto}"
        );
        let explicit = gpu.load_llm(&desc, &opts, Some(&all)).unwrap_err();
        assert!(
            matches!(
                explicit.reason,
                RefusalReason::OutOfMemory { .. } | RefusalReason::Device(_)
            ),
            "user-placed layers: {explicit}"
        );
        assert_eq!(
            gpu.bytes_resident(),
            resident,
            "a failed upload left device memory allocated"
        );
        assert!(
            GpuModel::try_load(gpu, model, CONTEXT, None).is_err(),
            "`cmf run` would not take the CPU path"
        );
        drop(held);
        wait_for_memory(gpu);

        let mut dev = device_engine(gpu, model);
        let (got, _) = run(&mut dev, tok, prompt);
        assert_eq!(got, want, "{FIXTURE} once the memory was back");
        assert!(dev.is_gpu(), "the device refused once the memory was back");

        let mut dev = device_engine(gpu, model);
        let Some(held) = take_while_running() else {
            return;
        };
        let (got, _) = run(&mut dev, tok, prompt);
        drop(held);
        assert_eq!(got, want, "{FIXTURE} with its memory taken mid-run");
        outcome = Some(Memory {
            moved: !dev.is_gpu(),
            auto_refusal: auto.to_string(),
            explicit_refusal: explicit.to_string(),
        });
    });
    outcome
}

/// The driver frees a killed process's memory shortly after it exits, not necessarily before
/// `wait` returns.
fn wait_for_memory(gpu: &Gpu) {
    let t0 = Instant::now();
    while gpu.vram_budget() < 1 << 30 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the device's memory did not come back: budget {} MiB",
            gpu.vram_budget() >> 20
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn skip_unsupported(why: &str) {
    gpu_skip::skip_unsupported(why)
}

fn cuda() -> Option<Gpu> {
    let g = Gpu::open(GpuMode::Auto).expect("auto never fails");
    if !g.is_active() {
        gpu_skip::skip_no_device("no CUDA device (`CMF_LOG=debug` says why)");
        return None;
    }
    Some(g)
}

fn fake() -> (Gpu, Arc<FakeFaults>) {
    let b = FakeBackend::new(1 << 40);
    let faults = b.faults.clone();
    (Gpu::with_backend(GpuMode::Auto, Arc::new(b)), faults)
}

/// Resets a fake fault when dropped (the other process going away).
struct Lifted<F: FnMut()>(F);
impl<F: FnMut()> Drop for Lifted<F> {
    fn drop(&mut self) {
        (self.0)()
    }
}

/// A second process running SGEMMs on the card while `cmf_llm` generates on it.
#[test]
fn contention_from_a_second_process() {
    let _s = serial();
    let Some(gpu) = cuda() else { return };
    let Some(c) = generation_under_load(&gpu, || Hog::start(hog::Mode::Compute)) else {
        return;
    };
    println!("{FIXTURE} beside an SGEMM loop: {}", c.summary);
    if !c.tripped {
        // Not a failure of cmf: the card's time slices kept every operation within budget.
        skip_unsupported(&format!(
            "the second process did not push device operations over the contention budget, so \
             the fall-back was not exercised (parity under load was checked): {}",
            c.summary
        ));
    } else if !c.moved {
        println!("the guard tripped on the last device operation of the run");
    }
}

/// A second process takes every free byte of device memory while a model is resident.
#[test]
fn device_memory_taken_by_a_second_process() {
    let _s = serial();
    let Some(gpu) = cuda() else { return };
    let take = || Hog::start(hog::Mode::Memory);
    let Some(m) = generation_without_memory(&gpu, take, take) else {
        return;
    };
    println!(
        "{FIXTURE} with the device's memory held elsewhere: automatic placement refused ({}); \
         user-placed layers refused ({}); a resident model whose memory went {}",
        m.auto_refusal,
        m.explicit_refusal,
        if m.moved {
            "moved to the CPU mid-run"
        } else {
            "kept running on the device (it allocates nothing while running)"
        },
    );
}

/// The fake device slowed past the budget (what time slicing with another process does): the
/// guard trips, the run moves to the CPU mid-generation and its ids equal the CPU's.
#[test]
fn fake_contention_moves_the_run_to_the_cpu() {
    let _s = serial();
    let (gpu, faults) = fake();
    let slow = (CONTENTION_FLOOR * 2).as_micros() as u64;
    let c = generation_under_load(&gpu, || {
        faults.delay_us.store(slow, Ordering::Relaxed);
        Some(Lifted(|| faults.delay_us.store(0, Ordering::Relaxed)))
    });
    let Some(c) = c else { return };
    println!("{FIXTURE} on a slowed fake device: {}", c.summary);
    assert!(c.tripped && c.moved, "{}", c.summary);
}

/// The fake device out of memory (what another process holding the card does): an allocation
/// while running, an automatic placement and user-placed layers all become refusals, and the
/// ids equal the CPU's.
#[test]
fn fake_allocation_failures_fall_back_to_the_cpu() {
    let _s = serial();
    let (gpu, faults) = fake();
    let m = generation_without_memory(
        &gpu,
        || {
            faults.alloc_limit.store(0, Ordering::Relaxed);
            Some(Lifted(|| {
                faults.alloc_limit.store(u64::MAX, Ordering::Relaxed)
            }))
        },
        || {
            faults.fail_next_alloc.store(true, Ordering::Relaxed);
            Some(())
        },
    )
    .expect("the fake always runs");
    assert!(
        m.moved,
        "the failed allocation did not move the run to the CPU"
    );
    assert!(
        m.explicit_refusal.contains("OUT_OF_MEMORY"),
        "{}",
        m.explicit_refusal
    );
    println!(
        "fake: automatic placement refused ({}); user-placed layers refused ({})",
        m.auto_refusal, m.explicit_refusal
    );
}

/// Without a device the second process starts, says why it cannot load the card and is
/// refused cleanly (the plumbing the device tests rely on: re-running this binary, reading its
/// report).
#[test]
fn second_process_without_a_device_reports_why() {
    let _s = serial();
    if Gpu::open(GpuMode::Auto)
        .expect("auto never fails")
        .is_active()
    {
        return; // the device tests above start it for real
    }
    let t0 = Instant::now();
    assert!(Hog::start(hog::Mode::Compute).is_none());
    assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
}

/// The second process of the device tests above (run only when they start it): see [`hog`].
#[test]
#[ignore = "started by the device tests as their second process"]
fn second_process() {
    hog::main_if_asked();
}
