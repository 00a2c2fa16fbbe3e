//! Writer → reader round trips: every codec, tokenizer bundle, streaming, failures that must
//! leave no output, and shard sets.

mod common;

use cmf_format::envelope::{Section, DATA_ALIGN, LARGE_TENSOR_ALIGN};
use cmf_format::{codec, hash64, CmfFile, CmfModel, CmfWriter, Dtype, Error};
use common::*;

#[test]
fn every_codec_round_trips_with_tokenizer_bundle() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.cmf");
    let mut w = CmfWriter::create(&path, header()).unwrap();
    let mut expected = Vec::new();
    for (i, (name, dtype, shape)) in tensor_set().into_iter().enumerate() {
        let vals = values(shape.iter().product(), i as u64, 0.5);
        let bytes = codec::encode(dtype, &shape, &vals).unwrap();
        w.add_tensor(&name, dtype, &shape, &bytes).unwrap();
        expected.push((name, dtype, shape, bytes));
    }
    w.add_tensor("model.config_json", Dtype::U8, &[5], b"{\"a\"}")
        .unwrap();
    w.set_vocab(TOKENIZER_JSON);
    assert_eq!(w.finish().unwrap(), path);
    assert_eq!(temp_files(dir.path()), 0);

    let f = CmfFile::open(&path).unwrap();
    assert_eq!(f.len(), expected.len() + 1);
    assert_eq!(f.vocab(), Some(TOKENIZER_JSON));
    assert_eq!(f.header().arch, arch());
    assert_eq!(f.header().tokenizer_config, header().tokenizer_config);
    assert_eq!(f.header().provenance, header().provenance);
    assert_eq!(f.envelope().section(Section::Data).off, DATA_ALIGN);
    for (name, dtype, shape, bytes) in &expected {
        let t = f.get(name).unwrap();
        assert_eq!(
            (t.dtype, t.shape.as_slice(), t.data),
            (*dtype, &shape[..], &bytes[..]),
            "{name}"
        );
        assert_eq!(t.hash, hash64(bytes));
        assert_eq!(t.file_offset % 64, 0);
        if bytes.len() >= 16 * 1024 {
            assert_eq!(t.file_offset % LARGE_TENSOR_ALIGN, 0, "{name}");
        }
        assert_eq!(
            t.to_f32().unwrap(),
            codec::decode_vec(*dtype, shape, bytes).unwrap()
        );
    }
    assert_eq!(f.get("model.config_json").unwrap().data, b"{\"a\"}");
    assert!(matches!(f.get("nope"), Err(Error::MissingTensor { .. })));
    let report = f.verify();
    assert!(report.is_ok(), "{:?}", report.problems);
    assert_eq!(report.sections_checked, vec!["header", "dir", "vocab"]);
    assert_eq!(report.tensors_checked, expected.len() + 1);
    let names: Vec<&str> = f.tensors().map(|t| t.name).collect();
    assert_eq!(
        names[0], "model.embed_tokens.weight",
        "directory keeps insertion order"
    );
    assert_eq!(
        f.tensor("model.norm.weight")
            .unwrap()
            .as_f32()
            .unwrap()
            .len(),
        64
    );
}

#[test]
fn streamed_tensor_equals_one_shot() {
    let dir = tempfile::tempdir().unwrap();
    let vals = values(64 * 64, 3, 1.0);
    let bytes = codec::encode(Dtype::Q8Row, &[64, 64], &vals).unwrap();
    let path = dir.path().join("s.cmf");
    let mut w = CmfWriter::create(&path, header()).unwrap();
    w.begin_tensor("w", Dtype::Q8Row, &[64, 64]).unwrap();
    for chunk in bytes.chunks(1000) {
        w.write_chunk(chunk).unwrap();
    }
    w.end_tensor().unwrap();
    w.finish().unwrap();
    let f = CmfFile::open(&path).unwrap();
    let t = f.get("w").unwrap();
    assert_eq!((t.data, t.hash), (&bytes[..], hash64(&bytes)));
    assert!(f.verify().is_ok());
}

#[test]
fn bad_input_is_refused_and_leaves_no_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.cmf");
    let mut w = CmfWriter::create(&path, header()).unwrap();
    w.add_tensor("a", Dtype::F32, &[2], &[0; 8]).unwrap();
    let err = |e: Error| e.to_string();
    assert!(err(w.add_tensor("a", Dtype::F32, &[2], &[0; 8]).unwrap_err()).contains("duplicate"));
    assert!(err(w.add_tensor("b", Dtype::F32, &[2], &[0; 7]).unwrap_err()).contains("tensor 'b'"));
    let e = err(w.add_tensor("c", Dtype::Q8Row, &[8], &[0; 24]).unwrap_err());
    assert!(e.contains("2-D"), "{e}");
    assert!(err(w.add_tensor("d", Dtype::F32, &[1; 7], &[0; 4]).unwrap_err()).contains("6 dims"));
    assert!(err(w
        .add_f32("e", Dtype::Q4Block, &[2], &[f32::NAN, 0.0])
        .unwrap_err())
    .contains("tensor 'e'"));
    assert_eq!(temp_files(dir.path()), 1);
    drop(w); // e.g. the converter failed half-way
    assert_eq!(temp_files(dir.path()), 0);
    assert!(!path.exists());

    // A streamed tensor that comes up short poisons the writer; finish refuses.
    let mut w = CmfWriter::create(&path, header()).unwrap();
    w.begin_tensor("x", Dtype::F32, &[4]).unwrap();
    w.write_chunk(&[0; 8]).unwrap();
    assert!(
        w.write_chunk(&[0; 9]).is_err(),
        "more bytes than the shape holds"
    );
    assert!(w.end_tensor().is_err());
    assert!(w.finish().is_err());
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "nothing left behind"
    );

    // Headers the reference reader would refuse never reach the disk.
    let mut h = header();
    h.arch.num_layers = 3;
    assert!(err(CmfWriter::create(&path, h).err().unwrap()).contains("layer_types"));
}

#[test]
fn finishing_replaces_an_existing_file_atomically() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.cmf");
    std::fs::write(&path, b"old contents").unwrap();
    let mut w = CmfWriter::create(&path, header()).unwrap();
    w.add_f32("t", Dtype::F16, &[3], &[1.0, 2.0, 3.0]).unwrap();
    assert_eq!(
        std::fs::read(&path).unwrap(),
        b"old contents",
        "old file intact until finish"
    );
    w.finish().unwrap();
    assert_eq!(
        CmfFile::open(&path)
            .unwrap()
            .get("t")
            .unwrap()
            .to_f32()
            .unwrap(),
        vec![1.0, 2.0, 3.0]
    );
}

#[test]
fn shard_set_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.cmf");
    // 20 KiB tensors, 48 KiB limit: two tensors (page-aligned) per shard → 3 shards for 5.
    let mut w = CmfWriter::create_sharded(&path, header(), 48 * 1024).unwrap();
    let mut all = Vec::new();
    for i in 0..5 {
        let vals = values(5 * 1024, i, 1.0);
        w.add_f32(&format!("t{i}"), Dtype::F32, &[5, 1024], &vals)
            .unwrap();
        all.push(vals);
    }
    w.set_vocab(TOKENIZER_JSON);
    let first = w.finish().unwrap();
    assert_eq!(first, dir.path().join("big-00001-of-00003.cmf"));
    assert!(!path.exists());
    let mut names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "big-00001-of-00003.cmf",
            "big-00002-of-00003.cmf",
            "big-00003-of-00003.cmf"
        ]
    );

    for no in 1..=3 {
        // Each shard is a complete file that verifies alone.
        let p = dir.path().join(format!("big-{no:05}-of-00003.cmf"));
        let f = CmfFile::open(&p).unwrap();
        assert!(f.verify().is_ok());
        let shard = f.header().shard.unwrap();
        assert_eq!((shard.no, shard.count), (no, 3));
        assert_eq!(f.vocab().is_some(), no == 1);
        assert_eq!(f.header().tokenizer_config.is_some(), no == 1);
        // Opening any shard opens the set.
        let m = CmfModel::open(&p).unwrap();
        assert_eq!(m.len(), 5);
        assert_eq!(m.vocab(), Some(TOKENIZER_JSON));
        assert_eq!(m.header().tokenizer_config, header().tokenizer_config);
        for (i, vals) in all.iter().enumerate() {
            assert_eq!(&m.get(&format!("t{i}")).unwrap().to_f32().unwrap(), vals);
        }
        assert!(m.verify().is_ok());
    }

    // A missing sibling is an error naming it.
    std::fs::remove_file(dir.path().join("big-00002-of-00003.cmf")).unwrap();
    let e = CmfModel::open(&first).err().unwrap().to_string();
    assert!(e.contains("big-00002-of-00003.cmf"), "{e}");
}

#[test]
fn sharded_output_that_fits_is_one_plain_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("small.cmf");
    let mut w = CmfWriter::create_sharded(&path, header(), 1 << 30).unwrap();
    w.add_f32("t", Dtype::F32, &[4], &[1.0; 4]).unwrap();
    assert_eq!(w.finish().unwrap(), path);
    let f = CmfFile::open(&path).unwrap();
    assert!(f.header().shard.is_none());
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn empty_model_is_valid() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("e.cmf");
    CmfWriter::create(&path, header())
        .unwrap()
        .finish()
        .unwrap();
    let f = CmfFile::open(&path).unwrap();
    assert!(f.is_empty());
    assert!(f.verify().is_ok());
}

#[test]
fn released_pages_read_back_intact_even_while_the_release_runs() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pages.cmf");
    let mut w = CmfWriter::create(&path, header()).unwrap();
    let mut expected = Vec::new();
    for (i, prefix) in ["a.", "a.", "b."].iter().enumerate() {
        let name = format!("{prefix}w{i}");
        let vals = values(64 * 1024 + 7, i as u64, 1.0); // a few hundred KiB: many whole pages
        let bytes = codec::encode(Dtype::F32, &[vals.len()], &vals).unwrap();
        w.add_tensor(&name, Dtype::F32, &[vals.len()], &bytes)
            .unwrap();
        expected.push((name, bytes));
    }
    w.finish().unwrap();
    let model = CmfModel::open(&path).unwrap();
    let sum: u64 = model
        .tensors()
        .map(|t| t.data.iter().map(|&b| b as u64).sum::<u64>())
        .sum();
    assert!(sum > 0);
    model.release_pages_in_background("a.");
    model.release_pages("b.");
    // Read while the background release may still be running, then again after it must be done.
    for round in 0..2 {
        for (name, bytes) in &expected {
            assert_eq!(
                model.get(name).unwrap().data,
                &bytes[..],
                "{name}, round {round}"
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(model.verify().is_ok());
    // Dropping the model while a release runs: the thread holds the mapping.
    model.release_pages_in_background("");
    drop(model);
}

/// Temp files the writer left in `dir`.
fn temp_files(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .ends_with(".tmp")
        })
        .count()
}

#[test]
fn concurrent_writers_and_stale_temp_files_do_not_collide() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.cmf");
    // A stale temp file under the old fixed name, as a killed writer left it: never reused.
    std::fs::write(dir.path().join("x.cmf.tmp"), b"stale").unwrap();
    let mut a = CmfWriter::create(&path, header()).unwrap();
    let mut b = CmfWriter::create(&path, header()).unwrap();
    a.add_f32("t", Dtype::F32, &[4], &[1.0; 4]).unwrap();
    b.add_f32("t", Dtype::F32, &[4], &[2.0; 4]).unwrap();
    b.add_f32("u", Dtype::F32, &[2], &[3.0; 2]).unwrap();
    a.finish().unwrap();
    b.finish().unwrap();
    let f = CmfFile::open(&path).unwrap();
    assert!(f.verify().is_ok());
    assert_eq!(f.len(), 2, "the last finished writer's file");
    assert_eq!(
        std::fs::read(dir.path().join("x.cmf.tmp")).unwrap(),
        b"stale"
    );
    assert_eq!(temp_files(dir.path()), 1);
}
