//! The per-op-class probe: for op classes where either arm can win (a lone large matvec, the
//! lm_head, a short prefill), time both arms on real calls and keep the faster one.
//!
//! Rules:
//! - a sample marked cold (first use, an upload or compile inside it) is discarded, and so is
//!   the first sample of each arm, which pays for caches and clocks;
//! - after [`CLEAN_SAMPLES`] clean samples of each arm the medians are compared and the verdict
//!   holds for the rest of the process;
//! - the verdict is written to a cache file keyed by (engine version, device name, class) so the
//!   next process starts decided: `$XDG_CACHE_HOME/cmf/gpu-probe.tsv` (else
//!   `~/.cache/cmf/gpu-probe.tsv`), one `version \t device \t class \t arm \t dev_us \t cpu_us`
//!   line per verdict;
//! - `CMF_GPU_PROBE=0` trusts the device: every class answers [`Arm::Device`], nothing is timed.
//!
//! Whole-layer and whole-token device graphs are not probed at all: the win there is that the
//! state never leaves the card, which a per-call timing of one arm cannot see.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

/// Clean samples of each arm needed before deciding.
pub const CLEAN_SAMPLES: usize = 3;

/// Op classes the probe decides separately.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpClass {
    /// One matrix-vector product outside a device graph.
    Matvec,
    /// Final norm + lm_head for one token, when the layers before it ran elsewhere.
    LmHead,
    /// A prompt of a few tokens (below the batched-GEMM break-even).
    ShortPrefill,
    /// A batched prefill GEMM outside a whole-layer device path.
    PrefillGemm,
}

impl OpClass {
    pub fn name(self) -> &'static str {
        match self {
            OpClass::Matvec => "matvec",
            OpClass::LmHead => "lm_head",
            OpClass::ShortPrefill => "short_prefill",
            OpClass::PrefillGemm => "prefill_gemm",
        }
    }

    fn from_name(s: &str) -> Option<OpClass> {
        [
            OpClass::Matvec,
            OpClass::LmHead,
            OpClass::ShortPrefill,
            OpClass::PrefillGemm,
        ]
        .into_iter()
        .find(|c| c.name() == s)
    }
}

/// One of the two ways to run an op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arm {
    Device,
    Cpu,
}

#[derive(Debug, Default)]
struct ClassState {
    seen: [usize; 2],
    clean: [Vec<Duration>; 2],
    verdict: Option<Arm>,
}

fn idx(arm: Arm) -> usize {
    match arm {
        Arm::Device => 0,
        Arm::Cpu => 1,
    }
}

/// Decides, per op class, which arm runs. Thread-safe; one per backend.
#[derive(Debug)]
pub struct Probe {
    trust_device: bool,
    engine_version: String,
    device_name: String,
    cache_file: Option<PathBuf>,
    classes: Mutex<HashMap<OpClass, ClassState>>,
}

impl Probe {
    /// A probe for `device_name`, reading `CMF_GPU_PROBE` and the default cache file.
    pub fn new(device_name: &str) -> Probe {
        let trust = std::env::var("CMF_GPU_PROBE")
            .map(|v| v.trim() == "0")
            .unwrap_or(false);
        Probe::with(
            device_name,
            env!("CARGO_PKG_VERSION"),
            default_cache_file(),
            trust,
        )
    }

    /// A probe with everything explicit (tests, or a caller with its own cache location).
    pub fn with(
        device_name: &str,
        engine_version: &str,
        cache_file: Option<PathBuf>,
        trust_device: bool,
    ) -> Probe {
        let probe = Probe {
            trust_device,
            engine_version: engine_version.to_string(),
            device_name: device_name.to_string(),
            cache_file,
            classes: Mutex::new(HashMap::new()),
        };
        probe.load_cache();
        probe
    }

    /// The arm to run for the next call of `class`: the verdict once there is one; before
    /// that, whichever arm has fewer samples (the device first).
    pub fn arm(&self, class: OpClass) -> Arm {
        if self.trust_device {
            return Arm::Device;
        }
        let map = self.lock();
        match map.get(&class) {
            None => Arm::Device,
            Some(s) => s.verdict.unwrap_or(if s.seen[1] < s.seen[0] {
                Arm::Cpu
            } else {
                Arm::Device
            }),
        }
    }

    /// The verdict for `class`, if decided (by this process or the cache file).
    pub fn verdict(&self, class: OpClass) -> Option<Arm> {
        if self.trust_device {
            return Some(Arm::Device);
        }
        self.lock().get(&class).and_then(|s| s.verdict)
    }

    /// Records one timed call. `cold` marks a call that included one-off work (an upload, a
    /// kernel compile, a graph capture); such samples never count.
    pub fn record(&self, class: OpClass, arm: Arm, elapsed: Duration, cold: bool) {
        if self.trust_device {
            return;
        }
        let decided = {
            let mut map = self.lock();
            let s = map.entry(class).or_default();
            if s.verdict.is_some() {
                return;
            }
            let i = idx(arm);
            s.seen[i] += 1;
            // The first sample of each arm pays for caches and clocks: discard it.
            if !cold && s.seen[i] > 1 {
                s.clean[i].push(elapsed);
            }
            if s.clean[0].len() >= CLEAN_SAMPLES && s.clean[1].len() >= CLEAN_SAMPLES {
                let (d, c) = (median(&s.clean[0]), median(&s.clean[1]));
                let v = if d <= c { Arm::Device } else { Arm::Cpu };
                s.verdict = Some(v);
                Some((v, d, c))
            } else {
                None
            }
        };
        if let Some((v, d, c)) = decided {
            super::log::debug(&format!(
                "probe: {} runs on the {} (device {:.1} µs, cpu {:.1} µs)",
                class.name(),
                if v == Arm::Device { "device" } else { "CPU" },
                d.as_secs_f64() * 1e6,
                c.as_secs_f64() * 1e6
            ));
            self.save_verdict(class, v, d, c);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<OpClass, ClassState>> {
        self.classes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reads verdicts for this (engine version, device) from the cache file. Malformed lines
    /// are skipped: the cache is an optimisation, never a reason to fail.
    fn load_cache(&self) {
        let Some(path) = &self.cache_file else { return };
        let Ok(text) = std::fs::read_to_string(path) else {
            return;
        };
        let mut map = self.lock();
        for line in text.lines() {
            let f: Vec<&str> = line.split('\t').collect();
            if f.len() < 4 || f[0] != self.engine_version || f[1] != self.device_name {
                continue;
            }
            let (Some(class), Some(arm)) = (OpClass::from_name(f[2]), parse_arm(f[3])) else {
                continue;
            };
            map.entry(class).or_default().verdict = Some(arm);
        }
    }

    /// Rewrites the cache file with this verdict replacing any older one for the same key.
    /// Written to a temporary file and renamed, so a reader never sees half a file.
    fn save_verdict(&self, class: OpClass, arm: Arm, dev: Duration, cpu: Duration) {
        let Some(path) = &self.cache_file else { return };
        let key = [
            self.engine_version.as_str(),
            self.device_name.as_str(),
            class.name(),
        ];
        let old = std::fs::read_to_string(path).unwrap_or_default();
        let mut out: String = old
            .lines()
            .filter(|l| {
                let f: Vec<&str> = l.split('\t').collect();
                f.len() < 3 || f[..3] != key
            })
            .map(|l| format!("{l}\n"))
            .collect();
        out.push_str(&format!(
            "{}\t{}\t{}\t{}\t{:.1}\t{:.1}\n",
            key[0],
            key[1],
            key[2],
            if arm == Arm::Device { "device" } else { "cpu" },
            dev.as_secs_f64() * 1e6,
            cpu.as_secs_f64() * 1e6
        ));
        if let Err(e) = write_atomic(path, out.as_bytes()) {
            super::log::debug(&format!("probe: cannot write {}: {e}", path.display()));
        }
    }
}

fn parse_arm(s: &str) -> Option<Arm> {
    match s {
        "device" => Some(Arm::Device),
        "cpu" => Some(Arm::Cpu),
        _ => None,
    }
}

fn median(v: &[Duration]) -> Duration {
    let mut s = v.to_vec();
    s.sort();
    s[s.len() / 2]
}

/// `$XDG_CACHE_HOME/cmf` or `~/.cache/cmf` (None when neither is known).
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        return Some(PathBuf::from(x).join("cmf"));
    }
    std::env::var_os("HOME")
        .filter(|v| !v.is_empty())
        .map(|h| PathBuf::from(h).join(".cache").join("cmf"))
}

fn default_cache_file() -> Option<PathBuf> {
    cache_dir().map(|d| d.join("gpu-probe.tsv"))
}

/// Writes `bytes` to `path` through a temporary file in the same directory and a rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    /// Drives the probe like a caller would: ask for the arm, "run" it, record its time.
    fn drive(p: &Probe, class: OpClass, dev_us: u64, cpu_us: u64, calls: usize) -> Vec<Arm> {
        (0..calls)
            .map(|_| {
                let arm = p.arm(class);
                p.record(
                    class,
                    arm,
                    us(if arm == Arm::Device { dev_us } else { cpu_us }),
                    false,
                );
                arm
            })
            .collect()
    }

    #[test]
    fn decides_for_the_faster_arm_after_clean_samples() {
        let p = Probe::with("fake", "t", None, false);
        let arms = drive(&p, OpClass::LmHead, 500, 100, 20);
        // Both arms are tried (1 discarded + CLEAN_SAMPLES each), then only the winner runs.
        let probing = 2 * (CLEAN_SAMPLES + 1);
        assert!(arms[..probing].contains(&Arm::Device) && arms[..probing].contains(&Arm::Cpu));
        assert_eq!(p.verdict(OpClass::LmHead), Some(Arm::Cpu));
        assert!(arms[probing..].iter().all(|a| *a == Arm::Cpu), "{arms:?}");
        // Other classes are undecided.
        assert_eq!(p.verdict(OpClass::Matvec), None);
    }

    #[test]
    fn cold_and_first_samples_do_not_count() {
        let p = Probe::with("fake", "t", None, false);
        // The device's first (cold) calls are terribly slow; they must not decide anything.
        for _ in 0..5 {
            p.record(OpClass::Matvec, Arm::Device, us(1_000_000), true);
        }
        assert_eq!(p.verdict(OpClass::Matvec), None);
        for _ in 0..=CLEAN_SAMPLES {
            p.record(OpClass::Matvec, Arm::Device, us(10), false);
            p.record(OpClass::Matvec, Arm::Cpu, us(20), false);
        }
        assert_eq!(p.verdict(OpClass::Matvec), Some(Arm::Device));
    }

    #[test]
    fn trust_device_skips_probing() {
        let p = Probe::with("fake", "t", None, true);
        let arms = drive(&p, OpClass::Matvec, 1000, 1, 10);
        assert!(arms.iter().all(|a| *a == Arm::Device));
    }

    #[test]
    fn verdict_is_cached_per_version_device_and_class() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("sub").join("gpu-probe.tsv");
        let p = Probe::with("H200", "1.0", Some(file.clone()), false);
        drive(&p, OpClass::LmHead, 100, 500, 12);
        assert_eq!(p.verdict(OpClass::LmHead), Some(Arm::Device));

        // A new process on the same device and version starts decided, without timing.
        let q = Probe::with("H200", "1.0", Some(file.clone()), false);
        assert_eq!(q.verdict(OpClass::LmHead), Some(Arm::Device));
        assert_eq!(q.verdict(OpClass::Matvec), None);
        // Another device or engine version does not inherit it.
        assert_eq!(
            Probe::with("A100", "1.0", Some(file.clone()), false).verdict(OpClass::LmHead),
            None
        );
        assert_eq!(
            Probe::with("H200", "1.1", Some(file.clone()), false).verdict(OpClass::LmHead),
            None
        );

        // A later verdict for the same key replaces the line instead of adding one.
        let r = Probe::with("H200", "1.1", Some(file.clone()), false);
        drive(&r, OpClass::LmHead, 900, 100, 12);
        let text = std::fs::read_to_string(&file).unwrap();
        assert_eq!(text.lines().count(), 2, "{text}");
        assert!(text.contains("1.1\tH200\tlm_head\tcpu"), "{text}");
    }

    #[test]
    fn malformed_cache_lines_are_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("gpu-probe.tsv");
        std::fs::write(
            &file,
            "garbage\n1.0\tH200\tlm_head\tmaybe\n1.0\tH200\tnope\tcpu\n\u{0}\u{1}\n",
        )
        .unwrap();
        let p = Probe::with("H200", "1.0", Some(file), false);
        assert_eq!(p.verdict(OpClass::LmHead), None);
    }
}
