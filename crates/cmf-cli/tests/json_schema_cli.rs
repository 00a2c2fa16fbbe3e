//! `cmf run --json-schema FILE` end to end on a random-weight fixture: the answer is JSON that
//! matches the schema whatever the weights would rather say, and bad schema files exit 1 with
//! the file named.

mod common;
use common::{cmf, converted};
use serde_json::Value;

#[test]
fn json_schema_answers_match_and_bad_files_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let model = converted(tmp.path());
    let f = model.to_str().unwrap();
    let schema = tmp.path().join("schema.json");
    std::fs::write(
        &schema,
        r#"{"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
            "tag": {"enum": ["a", "b"]}}, "required": ["n", "tag"], "additionalProperties": false}"#,
    )
    .unwrap();
    let s = schema.to_str().unwrap();
    for (seed, raw) in [("1", false), ("2", false), ("3", true)] {
        let mut args = vec![
            "run",
            f,
            "-p",
            "Give me JSON",
            "-n",
            "60",
            "--temp",
            "1",
            "--seed",
            seed,
        ];
        args.extend(["--json-schema", s]);
        if raw {
            args.push("--raw");
        }
        let o = cmf(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let out = String::from_utf8_lossy(&o.stdout);
        let v: Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out:?}"));
        let n = v["n"].as_u64().unwrap();
        assert!(n <= 99 && (v["tag"] == "a" || v["tag"] == "b"), "{v}");
        assert_eq!(v.as_object().unwrap().len(), 2, "{v}");
    }

    let missing = tmp.path().join("nope.json");
    let bad_json = tmp.path().join("bad.json");
    std::fs::write(&bad_json, "{not json").unwrap();
    let bad_schema = tmp.path().join("bad-schema.json");
    std::fs::write(&bad_schema, r#"{"type": "frobnicate"}"#).unwrap();
    for p in [&missing, &bad_json, &bad_schema] {
        let o = cmf(&["run", f, "-p", "x", "--json-schema", p.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(err.contains(p.to_str().unwrap()), "{err}");
    }
}
