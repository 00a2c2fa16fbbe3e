//! `cmf convert --zimage` and `cmf imagine` end to end on the tiny Z-Image fixture tree: a pack,
//! a PNG, and the messages and exit codes of bad requests (2 = usage, 1 = runtime).

mod common;
use common::{cmf, text};
use std::path::{Path, PathBuf};

fn tree() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/zimage/tiny")
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The fixture tree packed with the default codecs (q8_2f projections).
fn pack(dir: &Path) -> PathBuf {
    let out = dir.join("tiny.cmf");
    let o = cmf(&["convert", "--zimage", s(&tree()), "-o", s(&out)]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("z-image (turbo)"), "{}", text(&o));
    out
}

#[test]
fn convert_then_imagine_writes_a_png() {
    let dir = tempfile::tempdir().unwrap();
    let p = pack(dir.path());
    let png = dir.path().join("fox.png");
    let o = cmf(&[
        "imagine",
        s(&p),
        "--prompt",
        "a red fox",
        "--width",
        "48",
        "--height",
        "32",
        "--steps",
        "2",
        "-o",
        s(&png),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let out = text(&o);
    assert!(out.contains("timing: text encoder"), "{out}");
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    // IHDR width and height
    assert_eq!(u32::from_be_bytes(bytes[16..20].try_into().unwrap()), 48);
    assert_eq!(u32::from_be_bytes(bytes[20..24].try_into().unwrap()), 32);
    // no temp file left beside it
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name())
        .collect();
    assert!(
        left.iter().all(|n| !n.to_string_lossy().ends_with(".tmp")),
        "{left:?}"
    );
}

/// `cmf imagine PACK --prompt x ARGS -o PNG` must fail as a usage error (exit 2) whose message
/// holds every piece of `want`.
fn assert_usage_error(pack: &Path, png: &Path, args: &[&str], want: &[&str]) {
    let mut all = vec!["imagine", s(pack), "--prompt", "x"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["-o", s(png)]);
    let o = cmf(&all);
    assert_eq!(o.status.code(), Some(2), "{args:?}: {}", text(&o));
    for w in want {
        assert!(text(&o).contains(w), "{args:?}: {}", text(&o));
    }
}

#[test]
fn bad_requests_are_usage_errors() {
    let dir = tempfile::tempdir().unwrap();
    let p = pack(dir.path());
    let png = dir.path().join("x.png");
    assert_usage_error(
        &p,
        &png,
        &["--width", "40", "--height", "32"],
        &["--width: 40 is not a positive multiple of 16"],
    );
    assert_usage_error(&p, &png, &["--steps", "0"], &["--steps"]);
    let lat = dir.path().join("l.f32");
    std::fs::write(&lat, [0u8; 12]).unwrap();
    assert_usage_error(
        &p,
        &png,
        &["--width", "32", "--height", "32", "--latents", s(&lat)],
        &["latents", "need 256"],
    );
    assert_usage_error(&p, &png, &["--gpu", "fast"], &["fast"]);
    assert_usage_error(&p, &png, &["--repeat", "0"], &["--repeat"]);
    assert_usage_error(
        &p,
        &png,
        &["--dit-precision", "int4"],
        &["--dit-precision int4", "bf16, fp8, fp8-fast"],
    );
    assert!(!png.exists());
}

/// `--gpu off` keeps every stage on the CPU and says so; `--repeat 2` prints cold and warm runs.
#[test]
fn imagine_reports_where_stages_ran_and_repeats() {
    let dir = tempfile::tempdir().unwrap();
    let p = pack(dir.path());
    let png = dir.path().join("r.png");
    let args = [
        "imagine",
        s(&p),
        "--prompt",
        "a fox",
        "--width",
        "32",
        "--height",
        "32",
        "--steps",
        "1",
        "--gpu",
        "off",
        "--repeat",
        "2",
        "-o",
        s(&png),
    ];
    let o = cmf(&args);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let t = text(&o);
    assert!(
        t.contains("devices: text encoder cpu, DiT cpu, VAE cpu"),
        "{t}"
    );
    assert!(t.contains("runs: cold") && t.contains("warm"), "{t}");
    assert!(png.exists());
}

#[test]
fn a_file_that_is_not_a_zimage_pack_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let junk = dir.path().join("junk.cmf");
    std::fs::write(&junk, b"not a cmf file at all").unwrap();
    let o = cmf(&["imagine", s(&junk), "--prompt", "x"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("not a Z-Image pack"), "{}", text(&o));
    // a valid CMF of another architecture: the LLM fixture would do; build one with the writer
    let arch = cmf_format::Arch {
        arch_name: "qwen3".into(),
        hidden_size: 4,
        intermediate_size: 8,
        num_layers: 1,
        num_attention_heads: 1,
        num_kv_heads: 1,
        head_dim: 4,
        vocab_size: 2,
        layer_types: vec![cmf_format::LayerType::FullAttention],
        max_position_embeddings: 16,
        ..Default::default()
    };
    let other = dir.path().join("llm.cmf");
    let mut w = cmf_format::CmfWriter::create(
        &other,
        cmf_format::Header::new(arch, cmf_format::QuantType::F32),
    )
    .unwrap();
    w.add_f32("x", cmf_format::Dtype::F32, &[2], &[1.0, 2.0])
        .unwrap();
    w.finish().unwrap();
    let o = cmf(&["imagine", s(&other), "--prompt", "x"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("arch_name is `qwen3`, expected `z_image`"),
        "{}",
        text(&o)
    );
}

#[test]
fn long_prompts_are_truncated_with_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    let p = pack(dir.path());
    let png = dir.path().join("long.png");
    let prompt = "snowy birch forest fox ".repeat(200);
    let o = cmf(&[
        "imagine",
        s(&p),
        "--prompt",
        &prompt,
        "--width",
        "32",
        "--height",
        "32",
        "--steps",
        "1",
        "-o",
        s(&png),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("only the first 512 are used"),
        "{}",
        text(&o)
    );
}

#[test]
fn convert_refuses_a_directory_that_is_not_zimage() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.cmf");
    let o = cmf(&["convert", "--zimage", s(dir.path()), "-o", s(&out)]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("not a diffusers ZImagePipeline tree"),
        "{}",
        text(&o)
    );
    let o = cmf(&[
        "convert",
        "--zimage",
        s(&tree()),
        "-o",
        s(&out),
        "--vae-quant",
        "q8_2f",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(!out.exists());
}

/// `cmf imagine` on the pack the reference CLI made of the same tree (`cortiq imagine-pack`,
/// committed in fixtures/zimage/reference/): it runs, and since its weight payloads equal ours
/// (crates/cmf-zimage/tests/interop.rs) the PNG is byte-equal to the one from our own pack.
#[test]
fn imagine_renders_the_reference_clis_pack_like_ours() {
    let dir = tempfile::tempdir().unwrap();
    let reference = tree().join("../reference/tiny-cortiq.cmf");
    let ours = pack(dir.path());
    let mut pngs = Vec::new();
    for (name, p) in [("theirs", reference), ("ours", ours)] {
        let png = dir.path().join(format!("{name}.png"));
        let o = cmf(&[
            "imagine",
            s(&p),
            "--prompt",
            "a red fox",
            "--width",
            "64",
            "--height",
            "32",
            "--steps",
            "3",
            "--seed",
            "5",
            "-o",
            s(&png),
        ]);
        assert!(o.status.success(), "{name}: {}", text(&o));
        assert!(text(&o).contains("z-image (turbo)"), "{}", text(&o));
        pngs.push(std::fs::read(&png).unwrap());
    }
    assert_eq!(&pngs[0][..8], b"\x89PNG\r\n\x1a\n");
    assert!(pngs[0] == pngs[1], "the two packs render differently");
}
