//! Replays every committed fuzz corpus (`fuzz/corpus/<target>/`) through its target:
//! what fuzzing found once stays fixed, and each target's invariants are checked on
//! every test run, without nightly or libFuzzer. Every target must have its corpus and
//! its cargo-fuzz entry point (`fuzz/fuzz_targets/<target>.rs`), and nothing else may
//! lie there.

use std::fs;
use std::path::{Path, PathBuf};

use freight_fuzz::TARGETS;

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz")
}

fn names_in(dir: &Path, strip: &str) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().file_name().to_string_lossy().trim_end_matches(strip).to_string())
        .filter(|n| !n.starts_with('.'))
        .collect();
    names.sort();
    names
}

#[test]
fn every_target_has_a_corpus_and_an_entry_point_and_nothing_else_is_there() {
    let mut targets: Vec<String> = TARGETS.iter().map(|(n, _)| n.to_string()).collect();
    targets.sort();
    assert_eq!(names_in(&fuzz_dir().join("corpus"), ""), targets, "fuzz/corpus/");
    assert_eq!(names_in(&fuzz_dir().join("fuzz_targets"), ".rs"), targets, "fuzz/fuzz_targets/");
}

#[test]
fn every_committed_input_passes_its_target() {
    for (name, target) in TARGETS {
        let dir = fuzz_dir().join("corpus").join(name);
        let mut inputs: Vec<PathBuf> = fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.unwrap().path())
            .filter(|p| p.is_file())
            .collect();
        inputs.sort();
        assert!(inputs.len() >= 10, "the {name} corpus holds {} inputs: was it committed?", inputs.len());
        for input in &inputs {
            let bytes = fs::read(input).unwrap();
            let outcome = std::panic::catch_unwind(|| target(&bytes));
            assert!(outcome.is_ok(), "{name}: {} broke an invariant", input.display());
        }
    }
}
