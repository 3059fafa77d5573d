//! Hostile inputs kept as files: each must decode to an error (or, for the `ok-` files,
//! succeed), never panic. New cases found by fuzzing or in the field go into corpus/.

use std::fs;
use std::path::Path;

use freight_proto::frame::{FrameBuf, MAX_HEADER};
use freight_proto::metadata::AgentMetadata;
use freight_proto::Error;

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
fn frame_corpus() {
    for (name, bytes) in cases("frame") {
        // The file is all a reader gets: a frame it does not hold whole is an error.
        let mut buf = FrameBuf::new(MAX_HEADER);
        buf.extend(&bytes);
        let r = buf.take().and_then(|f| {
            let f = f.ok_or_else(|| Error::Protocol(format!("a frame cut after {} bytes", bytes.len())))?;
            f.payload_len()
        });
        assert_eq!(r.is_ok(), name.starts_with("ok-"), "{name}: {:?}", r.err());
    }
}
