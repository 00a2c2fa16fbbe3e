//! Chunked, parallel encoding (emit.rs) writes exactly the bytes of encoding the whole tensor.

use cmf_convert::emit::{part_sizes, write_tensor};
use cmf_format::{codec, CmfFile, CmfWriter, Dtype, Header};

fn header() -> Header {
    let arch = cmf_format::Arch {
        arch_name: "test".into(),
        ..Default::default()
    };
    Header::new(arch, cmf_format::QuantType::F32)
}

#[test]
fn chunked_encoding_equals_whole_encoding_for_every_codec() {
    // 600 × 4096 = 2.4 M values: three chunks of 256 rows, the last one short.
    let (rows, cols) = (600, 4096);
    let value = |r: usize, c: usize| {
        ((r * 7919 + c * 104_729) % 2001) as f32 / 1000.0 - 1.0 + (r % 5) as f32
    };
    let all: Vec<f32> = (0..rows * cols)
        .map(|i| value(i / cols, i % cols))
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let codecs = [
        Dtype::F32,
        Dtype::F16,
        Dtype::Bf16,
        Dtype::Q8Row,
        Dtype::Q8_2f,
        Dtype::Q4Block,
        Dtype::Q4Tiled,
        Dtype::Q4Tp,
    ];
    let path = dir.path().join("t.cmf");
    let mut w = CmfWriter::create(&path, header()).unwrap();
    for d in codecs {
        let stats = write_tensor(
            &mut w,
            "src".as_ref(),
            d.name(),
            d,
            &[rows, cols],
            true,
            &|r0, r1, out| {
                out.copy_from_slice(&all[r0 * cols..r1 * cols]);
                Ok(())
            },
        )
        .unwrap();
        assert!(stats.relative_rms() < 0.2, "{d}: {}", stats.relative_rms());
        if d == Dtype::F32 {
            assert_eq!(stats.err_sq, 0.0);
        }
    }
    w.finish().unwrap();
    let f = CmfFile::open(&path).unwrap();
    for d in codecs {
        let t = f.get(d.name()).unwrap();
        let whole = codec::encode(d, &[rows, cols], &all).unwrap();
        assert_eq!(t.dtype, d);
        assert!(
            t.data == whole.as_slice(),
            "{d}: chunked bytes differ from whole-tensor encoding"
        );
        assert!(part_sizes(d, cols).is_some() || d == Dtype::Q8_2f);
    }
}

#[test]
fn row_errors_name_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.cmf");
    let mut w = CmfWriter::create(&path, header()).unwrap();
    let e = write_tensor(
        &mut w,
        "in.gguf".as_ref(),
        "blk.w",
        Dtype::Q8Row,
        &[4, 64],
        false,
        &|_, _, _| Err("bad block".into()),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("in.gguf") && e.contains("blk.w") && e.contains("bad block"),
        "{e}"
    );
    let e = write_tensor(
        &mut w,
        "in".as_ref(),
        "nan",
        Dtype::Q8Row,
        &[4, 64],
        false,
        &|_, _, out| {
            out.fill(f32::NAN);
            Ok(())
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("nan"), "{e}");
}
