//! Embeds the kernel images in `cubins/` (see src/cuda/runtime/prebuilt.rs) as a table of
//! (file stem, bytes).

use std::fmt::Write as _;
use std::path::Path;

fn main() {
    // Read at run time: `env!` would freeze the directory of whichever checkout compiled this
    // script, and a build directory shared between checkouts would then embed another tree's images.
    let manifest = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let dir = Path::new(&manifest).join("cubins");
    println!("cargo:rerun-if-changed={}", dir.display());
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "cubin"))
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    let mut out = String::from("pub static PREBUILT: &[(&str, &[u8])] = &[\n");
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
        let stem = f
            .file_stem()
            .and_then(|s| s.to_str())
            .expect("utf-8 file names");
        writeln!(
            out,
            "    ({stem:?}, include_bytes!({:?})),",
            f.display().to_string()
        )
        .expect("writing to a String");
    }
    out.push_str("];\n");
    let dest = Path::new(&std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"))
        .join("prebuilt_cubins.rs");
    std::fs::write(dest, out).expect("writing prebuilt_cubins.rs");
}
