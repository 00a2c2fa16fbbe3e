//! Run-time compilation of the kernel sources with NVRTC, straight to a CUBIN for the device's
//! own arch (no PTX, so the driver does no JIT), cached on disk.
//!
//! Images compiled ahead of time and embedded in the binary come first (`prebuilt.rs`: the
//! Hopper kernels of the demo models), then the disk cache: `$XDG_CACHE_HOME/cmf/cubin/` (else
//! `~/.cache/cmf/cubin/`), one file per `{name}-{key}.cubin`, key = FNV-1a-64 over (source,
//! options, arch, NVRTC version). A stale or corrupt file is simply recompiled: the module load
//! fails and the entry is rewritten (a rejected embedded image is not offered again).
//!
//! Concurrency: threads may compile different sources at once (a first run compiles its modules
//! in parallel, kernels.rs `compile_parallel` / `prefetch`); two requests for the same key in one
//! process share one compilation (the second waits for the first's result).

use super::source::{fnv1a, options};
use cudarc::nvrtc::sys as nv;
use std::collections::HashMap;
use std::ffi::{c_char, CString};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

/// Whether libnvrtc can be loaded (never panics).
pub fn available() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { nv::is_culib_present() }
}

/// NVRTC's (major, minor).
pub fn version() -> Result<(i32, i32), String> {
    let (mut a, mut b) = (0, 0);
    // SAFETY: writes two ints.
    check(unsafe { nv::nvrtcVersion(&mut a, &mut b) }, "nvrtcVersion")?;
    Ok((a, b))
}

fn check(r: nv::nvrtcResult, what: &str) -> Result<(), String> {
    if r == nv::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what}: {r:?}"))
    }
}

fn cache_dir() -> Option<PathBuf> {
    crate::facade::files::cache_dir().map(|d| d.join("cubin"))
}

/// A compiled image and the compiler's log (resource usage when verbose).
pub struct Compiled {
    pub cubin: Vec<u8>,
    pub log: String,
    pub from_cache: bool,
}

/// Compiles `src` for `arch` (e.g. `sm_90`) with `defines` (`("HD", "128")` → `-DHD=128`).
/// `CMF_GPU_PTXAS_VERBOSE=1` asks ptxas for its register/spill report (returned in `log`,
/// and then the cache is bypassed so the report is always produced).
pub fn compile(
    name: &str,
    src: &str,
    arch: &str,
    defines: &[(&str, String)],
) -> Result<Compiled, String> {
    let verbose = std::env::var("CMF_GPU_PTXAS_VERBOSE")
        .map(|v| v == "1")
        .unwrap_or(false);
    super::prebuilt::log_job(name, arch, defines);
    if !verbose {
        if let Some(cubin) = super::prebuilt::find(name, src, arch, defines) {
            return Ok(Compiled {
                cubin: cubin.to_vec(),
                log: String::new(),
                from_cache: true,
            });
        }
    }
    let mut opts = options(arch, defines);
    if verbose {
        opts.push("--ptxas-options=-v".into());
    }
    let (maj, min) = version()?;
    let ver = format!("{maj}.{min}");
    let joined = opts.join(" ");
    let key = fnv1a(&[
        src.as_bytes(),
        joined.as_bytes(),
        arch.as_bytes(),
        ver.as_bytes(),
    ]);
    let path = cache_dir().map(|d| d.join(format!("{name}-{key:016x}.cubin")));
    if !verbose {
        if let Some(bytes) = path.as_ref().and_then(|p| std::fs::read(p).ok()) {
            if !bytes.is_empty() {
                return Ok(Compiled {
                    cubin: bytes,
                    log: String::new(),
                    from_cache: true,
                });
            }
        }
    }
    if verbose {
        let (cubin, log) = compile_uncached(name, src, &opts)?;
        return Ok(Compiled {
            cubin,
            log,
            from_cache: false,
        });
    }
    // One compilation per key and process: a request that finds one running waits for it.
    let slot = in_flight(key);
    let done = slot.get_or_init(|| {
        let t0 = std::time::Instant::now();
        let (cubin, log) = compile_uncached(name, src, &opts)?;
        crate::facade::log::debug(&format!(
            "nvrtc: compiled {name} ({joined}) in {:.2} s",
            t0.elapsed().as_secs_f64()
        ));
        if let Some(p) = &path {
            if let Err(e) = crate::facade::files::write_atomic(p, &cubin) {
                crate::facade::log::debug(&format!("cannot cache {}: {e}", p.display()));
            }
        }
        Ok(Arc::new((cubin, log)))
    });
    let (cubin, log) = done.as_ref().map_err(Clone::clone)?.as_ref();
    Ok(Compiled {
        cubin: cubin.clone(),
        log: log.clone(),
        from_cache: false,
    })
}

/// Compiles without any cache (the ahead-of-time build of the embedded images).
pub fn compile_fresh(
    name: &str,
    src: &str,
    arch: &str,
    defines: &[(&str, String)],
) -> Result<Vec<u8>, String> {
    compile_uncached(name, src, &options(arch, defines)).map(|(cubin, _)| cubin)
}

/// A compilation's result, shared by every request for its key.
type Slot = Arc<OnceLock<Result<Arc<(Vec<u8>, String)>, String>>>;

/// The process's compilations by key (kept: a cubin is at most a few MB, and a later request
/// where the disk cache is unwritable then needs no second compile).
fn in_flight(key: u64) -> Slot {
    static SLOTS: OnceLock<Mutex<HashMap<u64, Slot>>> = OnceLock::new();
    let map = SLOTS.get_or_init(|| Mutex::new(HashMap::new()));
    let mut map = map.lock().unwrap_or_else(|p| p.into_inner());
    map.entry(key).or_default().clone()
}

/// Drops a cached image (after the driver rejected it), and stops offering the embedded one.
pub fn forget(name: &str, src: &str, arch: &str, defines: &[(&str, String)]) {
    let _ = (src, arch, defines);
    super::prebuilt::reject(name);
    if let Some(d) = cache_dir() {
        if let Ok(rd) = std::fs::read_dir(d) {
            for e in rd.flatten() {
                if e.file_name()
                    .to_string_lossy()
                    .starts_with(&format!("{name}-"))
                {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
    }
}

fn compile_uncached(name: &str, src: &str, opts: &[String]) -> Result<(Vec<u8>, String), String> {
    let c_src = CString::new(src).map_err(|_| format!("{name}: source contains a NUL byte"))?;
    let c_name = CString::new(format!("{name}.cu")).map_err(|_| format!("{name}: bad name"))?;
    let c_opts: Vec<CString> = opts
        .iter()
        .map(|o| CString::new(o.as_str()).expect("options have no NUL"))
        .collect();
    let opt_ptrs: Vec<*const c_char> = c_opts.iter().map(|o| o.as_ptr()).collect();
    let mut prog: nv::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: valid C strings that outlive the program; no headers passed.
    check(
        unsafe {
            nv::nvrtcCreateProgram(
                &mut prog,
                c_src.as_ptr(),
                c_name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        },
        "nvrtcCreateProgram",
    )?;
    // SAFETY: prog was created above; option pointers are valid for the call.
    let res = unsafe { nv::nvrtcCompileProgram(prog, opt_ptrs.len() as i32, opt_ptrs.as_ptr()) };
    let log = program_log(prog);
    let out = if res != nv::nvrtcResult::NVRTC_SUCCESS {
        Err(format!("compiling {name}.cu ({res:?}):\n{log}"))
    } else {
        let mut size = 0usize;
        // SAFETY: prog compiled successfully; the buffer is sized by the first call.
        match check(
            unsafe { nv::nvrtcGetCUBINSize(prog, &mut size) },
            "nvrtcGetCUBINSize",
        ) {
            Err(e) => Err(e),
            Ok(()) => {
                let mut buf = vec![0u8; size];
                check(
                    unsafe { nv::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut c_char) },
                    "nvrtcGetCUBIN",
                )
                .map(|_| (buf, log))
            }
        }
    };
    // SAFETY: destroys the program created above, once.
    unsafe { nv::nvrtcDestroyProgram(&mut prog) };
    out
}

fn program_log(prog: nv::nvrtcProgram) -> String {
    let mut size = 0usize;
    // SAFETY: prog is live; the buffer is sized by the first call.
    if unsafe { nv::nvrtcGetProgramLogSize(prog, &mut size) } != nv::nvrtcResult::NVRTC_SUCCESS
        || size == 0
    {
        return String::new();
    }
    let mut buf = vec![0u8; size];
    unsafe { nv::nvrtcGetProgramLog(prog, buf.as_mut_ptr() as *mut c_char) };
    String::from_utf8_lossy(&buf)
        .trim_end_matches('\0')
        .trim()
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_separates_parts() {
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
        assert_eq!(fnv1a(&[b"x"]), fnv1a(&[b"x"]));
    }
}
