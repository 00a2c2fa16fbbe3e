//! Devices and memory: per-thread device pinning, the VRAM budget, and the byte counters a
//! benchmark reads to prove a steady-state window uploads nothing.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

thread_local! {
    static PINNED: Cell<Option<usize>> = const { Cell::new(None) };
}

/// Pins the calling thread to device `ordinal`: backends opened or used from this thread
/// bind that device. Returns the previous pin.
pub fn pin_thread(ordinal: usize) -> Option<usize> {
    PINNED.with(|p| p.replace(Some(ordinal)))
}

/// Removes this thread's pin (back to device 0).
pub fn unpin_thread() {
    PINNED.with(|p| p.set(None));
}

/// The device this thread is pinned to (0 when unpinned).
pub fn pinned_device() -> usize {
    PINNED.with(|p| p.get()).unwrap_or(0)
}

/// What a backend says about its device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// e.g. `NVIDIA H200`.
    pub name: String,
    pub ordinal: usize,
    /// Devices of this backend's kind in the machine.
    pub count: usize,
    /// e.g. `sm_90a`.
    pub arch: String,
    pub total_bytes: u64,
    pub free_bytes: u64,
}

/// Bytes the backend holds and has moved; all counters only grow except `resident`.
#[derive(Debug, Default)]
pub struct MemStats {
    resident: AtomicU64,
    uploaded: AtomicU64,
    downloaded: AtomicU64,
}

impl MemStats {
    pub fn add_resident(&self, n: u64) {
        self.resident.fetch_add(n, Ordering::Relaxed);
    }
    pub fn sub_resident(&self, n: u64) {
        self.resident.fetch_sub(n, Ordering::Relaxed);
    }
    pub fn add_uploaded(&self, n: u64) {
        self.uploaded.fetch_add(n, Ordering::Relaxed);
    }
    pub fn add_downloaded(&self, n: u64) {
        self.downloaded.fetch_add(n, Ordering::Relaxed);
    }
    /// Device bytes allocated now.
    pub fn resident(&self) -> u64 {
        self.resident.load(Ordering::Relaxed)
    }
    /// Host → device bytes since the backend opened.
    pub fn uploaded(&self) -> u64 {
        self.uploaded.load(Ordering::Relaxed)
    }
    /// Device → host bytes since the backend opened.
    pub fn downloaded(&self) -> u64 {
        self.downloaded.load(Ordering::Relaxed)
    }
}

/// The environment variable that caps the VRAM budget (diagnostics: forces partial placement).
pub const ENV_VRAM_BUDGET: &str = "CMF_GPU_VRAM_BUDGET";

/// The device bytes the engine may use: 90 % of what is free at open, less 512 MiB for the
/// driver, cuBLAS workspaces and fragmentation; capped by `CMF_GPU_VRAM_BUDGET` (bytes, or
/// with a K/M/G suffix) when set.
pub fn vram_budget(free_bytes: u64) -> u64 {
    let own = (free_bytes / 10 * 9).saturating_sub(512 << 20);
    match std::env::var(ENV_VRAM_BUDGET)
        .ok()
        .and_then(|v| parse_bytes(&v))
    {
        Some(cap) => own.min(cap),
        None => own,
    }
}

/// `123`, `64K`, `512M`, `20G` (binary units) → bytes.
pub fn parse_bytes(s: &str) -> Option<u64> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last()? {
        (i, 'k' | 'K') => (&s[..i], 1u64 << 10),
        (i, 'm' | 'M') => (&s[..i], 1 << 20),
        (i, 'g' | 'G') => (&s[..i], 1 << 30),
        _ => (s, 1),
    };
    num.trim().parse::<u64>().ok()?.checked_mul(mult)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinning_is_per_thread() {
        assert_eq!(pinned_device(), 0);
        assert_eq!(pin_thread(3), None);
        assert_eq!(pinned_device(), 3);
        std::thread::spawn(|| assert_eq!(pinned_device(), 0))
            .join()
            .unwrap();
        unpin_thread();
        assert_eq!(pinned_device(), 0);
    }

    #[test]
    fn byte_sizes() {
        assert_eq!(parse_bytes("123"), Some(123));
        assert_eq!(parse_bytes("2G"), Some(2 << 30));
        assert_eq!(parse_bytes("64k"), Some(64 << 10));
        assert_eq!(parse_bytes("x"), None);
        assert_eq!(parse_bytes(""), None);
    }

    #[test]
    fn counters() {
        let m = MemStats::default();
        m.add_resident(100);
        m.add_uploaded(100);
        m.sub_resident(40);
        assert_eq!((m.resident(), m.uploaded(), m.downloaded()), (60, 100, 0));
    }
}
