//! cmf-prebuild-kernels: builds the kernel images the binary embeds (src/cuda/runtime/prebuilt.rs)
//! from the current sources (found through `cuda::catalog`), for the modules in `cubins/jobs.tsv`.
//! Needs NVRTC, not a GPU.
//!
//! usage: cmf-prebuild-kernels [--dir DIR] [--add-jobs LOG]... [--check]
//!   --dir DIR       the images' folder (default: this crate's `cubins/`)
//!   --add-jobs LOG  first merge the jobs a run logged (`CMF_KERNEL_JOBS_LOG=LOG`) into jobs.tsv
//!   --check         build nothing: list missing and stale images, exit 1 if there are any
//! Writes `{name}-{key}.cubin` for every job (temporary file, then rename), removes the other
//! `.cubin` files, and records the NVRTC version in `NVRTC_VERSION`.

use cmf_gpu::cuda::catalog::source_of;
use cmf_gpu::cuda::runtime::{nvrtc, prebuilt};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

fn main() -> ExitCode {
    let mut dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/cubins"));
    let mut logs = Vec::new();
    let mut check = false;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--dir" => dir = it.next().map(PathBuf::from).unwrap_or(dir),
            "--add-jobs" => logs.extend(it.next().map(PathBuf::from)),
            "--check" => check = true,
            other => {
                eprintln!("cmf-prebuild-kernels: unknown flag {other}");
                return ExitCode::from(2);
            }
        }
    }
    match run(&dir, &logs, check) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("cmf-prebuild-kernels: {e}");
            ExitCode::from(1)
        }
    }
}

fn read(path: &Path) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), String> {
    cmf_gpu::facade::write_atomic(path, bytes).map_err(|e| format!("{}: {e}", path.display()))
}

fn run(dir: &Path, logs: &[PathBuf], check: bool) -> Result<bool, String> {
    let tsv = dir.join("jobs.tsv");
    let text = read(&tsv)?;
    let mut jobs = prebuilt::jobs(&text).map_err(|e| format!("{}: {e}", tsv.display()))?;
    if !logs.is_empty() {
        let mut set: BTreeSet<String> = jobs.iter().map(|j| j.to_line()).collect();
        for log in logs {
            let logged =
                prebuilt::jobs(&read(log)?).map_err(|e| format!("{}: {e}", log.display()))?;
            set.extend(logged.iter().map(|j| j.to_line()));
        }
        let header: String = text
            .lines()
            .filter(|l| l.starts_with('#'))
            .map(|l| format!("{l}\n"))
            .collect();
        let body: String = set.iter().map(|l| format!("{l}\n")).collect();
        write_atomic(&tsv, format!("{header}{body}").as_bytes())?;
        jobs = prebuilt::jobs(&body).map_err(|e| format!("merged jobs: {e}"))?;
        println!("jobs.tsv: {} jobs", jobs.len());
    }
    let mut wanted = Vec::new();
    for j in &jobs {
        let (full, stem) = j.current(source_of)?;
        wanted.push((j, full, stem));
    }
    let existing: BTreeSet<String> = std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .flatten()
        .filter_map(|e| {
            let p = e.path();
            (p.extension()? == "cubin").then(|| p.file_stem()?.to_str().map(String::from))?
        })
        .collect();
    let want_set: BTreeSet<String> = wanted.iter().map(|w| w.2.clone()).collect();
    let missing: Vec<&String> = want_set.difference(&existing).collect();
    let stale: Vec<&String> = existing.difference(&want_set).collect();
    if check {
        for m in &missing {
            println!("missing {m}.cubin");
        }
        for s in &stale {
            println!("stale {s}.cubin");
        }
        return Ok(missing.is_empty() && stale.is_empty());
    }
    let (maj, min) = nvrtc::version()?;
    let todo: Vec<_> = wanted.iter().filter(|w| missing.contains(&&w.2)).collect();
    let results: Vec<Result<(), String>> = std::thread::scope(|s| {
        let handles: Vec<_> = todo
            .iter()
            .map(|(j, full, stem)| {
                s.spawn(move || {
                    let t0 = std::time::Instant::now();
                    let cubin = nvrtc::compile_fresh(&j.name, full, &j.arch, &j.define_refs())?;
                    write_atomic(&dir.join(format!("{stem}.cubin")), &cubin)?;
                    println!(
                        "built {stem}.cubin ({} KiB, {:.1} s)",
                        cubin.len() / 1024,
                        t0.elapsed().as_secs_f64()
                    );
                    Ok(())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a compile thread panicked".into()))
            })
            .collect()
    });
    results.into_iter().collect::<Result<Vec<()>, String>>()?;
    for s in &stale {
        let p = dir.join(format!("{s}.cubin"));
        std::fs::remove_file(&p).map_err(|e| format!("{}: {e}", p.display()))?;
        println!("removed {s}.cubin");
    }
    write_atomic(
        &dir.join("NVRTC_VERSION"),
        format!("{maj}.{min}\n").as_bytes(),
    )?;
    println!(
        "{} images ({} built, {} removed), NVRTC {maj}.{min}",
        want_set.len(),
        todo.len(),
        stale.len()
    );
    Ok(true)
}
