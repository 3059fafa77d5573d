//! Hostile inputs kept as files: each must decode to an error (or, for the `ok-` files,
//! succeed), never panic. New cases found by fuzzing or in the field go into corpus/.

use std::fs;
use std::path::Path;

use freight_core::metadata::AgentMetadata;
use freight_core::wire;

fn cases(dir: &str) -> Vec<(String, Vec<u8>)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus").join(dir);
    let mut out: Vec<_> = fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("{}: {e}", root.display()))
        .map(|e| e.unwrap().path())
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), fs::read(&p).unwrap()))
        .collect();
    out.sort();
    assert!(out.len() >= 5, "corpus {dir} is nearly empty");
    out
}

#[test]
fn metadata_corpus() {
    for (name, bytes) in cases("metadata") {
        let r = AgentMetadata::decode(&bytes);
        assert_eq!(r.is_ok(), name.starts_with("ok-"), "{name}: {:?}", r.err());
    }
}

#[test]
fn wire_corpus() {
    for (name, bytes) in cases("wire") {
        let r = wire::read_frame(&mut &bytes[..]).and_then(|f| {
            let f = f.ok_or_else(|| freight_core::Error::Protocol("empty".into()))?;
            f.payload_len()
        });
        assert_eq!(r.is_ok(), name.starts_with("ok-"), "{name}: {:?}", r.err());
    }
}
