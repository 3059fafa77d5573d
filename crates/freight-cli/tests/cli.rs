//! The built `freight` binary, end to end: real child processes, real transfers.

use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};

fn freight(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_freight")).args(args).output().expect("the freight binary runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Checks a `bench p2p --json` document: parses, every row verified and moved bytes.
fn check_report(out: &Output, rows: usize, transport: &str) -> serde_json::Value {
    assert!(out.status.success(), "exit {:?}\nstderr:\n{}", out.status, text(&out.stderr));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stdout is one JSON document");
    assert_eq!(doc["verified"], true);
    assert!(doc["host"]["cpus"].as_u64().unwrap() >= 1);
    let got = doc["rows"].as_array().expect("rows");
    assert_eq!(got.len(), rows);
    for r in got {
        assert_eq!(r["verified"], true, "{r}");
        assert_eq!(r["transport"], transport, "{r}");
        assert!(r["gbps"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["transfer_us"]["p99"].as_f64().unwrap() >= r["transfer_us"]["min"].as_f64().unwrap());
    }
    doc
}

#[test]
fn demo_moves_and_verifies_over_both_transports() {
    let out = freight(&["demo"]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "exit {:?}\nstdout:\n{stdout}\nstderr:\n{}", out.status, text(&out.stderr));
    assert!(stdout.contains("over shm"), "{stdout}");
    assert!(stdout.contains("over tcp"), "{stdout}");
    assert!(stdout.contains("demo passed"), "{stdout}");
    assert!(!stdout.contains("MISMATCH"), "{stdout}");
}

#[test]
fn bench_p2p_json_is_verified() {
    let out = freight(&[
        "bench",
        "p2p",
        "--block-sizes",
        "4KiB,64KiB",
        "--batch-sizes",
        "1,4",
        "--iters",
        "5",
        "--warmup",
        "1",
        "--transport",
        "shm",
        "--json",
    ]);
    let doc = check_report(&out, 4, "shm");
    assert_eq!(doc["config"]["op"], "WRITE");
    assert_eq!(doc["rows"][3]["bytes"], 4 * 65536);
    assert!(doc["rows"][0]["prepare_us"]["avg"].is_number());

    let out = freight(&[
        "bench",
        "p2p",
        "--block-sizes",
        "4KiB",
        "--batch-sizes",
        "8",
        "--iters",
        "3",
        "--warmup",
        "0",
        "--op",
        "READ",
        "--mode",
        "oneshot",
        "--transport",
        "tcp",
        "--random-order",
        "--memcpy-baseline",
        "--json",
    ]);
    let doc = check_report(&out, 1, "tcp");
    assert!(doc["rows"][0]["prepare_us"].is_null(), "oneshot has no separate prepare time");
    assert!(doc["rows"][0]["memcpy_gbps"].as_f64().unwrap() > 0.0);
}

#[test]
fn bench_p2p_with_separate_target_and_initiator() {
    let mut target = Command::new(env!("CARGO_BIN_EXE_freight"))
        .args(["bench", "p2p", "--role", "target", "--listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    let mut lines = BufReader::new(target.stdout.take().unwrap());
    lines.read_line(&mut first).unwrap();
    let addr = first.split("listening on ").nth(1).and_then(|r| r.split([' ', ',']).next()).expect(&first).to_string();
    let out = freight(&[
        "bench",
        "p2p",
        "--connect",
        &addr,
        "--block-sizes",
        "16KiB",
        "--batch-sizes",
        "2",
        "--iters",
        "3",
        "--json",
    ]);
    check_report(&out, 1, "shm");
    assert!(target.wait().unwrap().success(), "the target exits cleanly after the session");
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut lines, &mut rest).unwrap();
    assert!(rest.contains("finished"), "{rest}");
}

#[test]
fn usage_errors_exit_2_and_help_exits_0() {
    let out = freight(&["bench", "p2p", "--iters", "0"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("--iters"));
    let out = freight(&["bench", "p2p", "--block-sizes", "1GiB", "--batch-sizes", "4"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    let out = freight(&["--help"]);
    assert_eq!(out.status.code(), Some(0));
    for cmd in ["demo", "bench"] {
        assert!(text(&out.stdout).contains(cmd));
    }
    assert!(text(&freight(&["--version"]).stdout).starts_with("freight "));
}

/// Sizes no host holds (and no address space maps, so that a build without the checks
/// fails with an error rather than memory pressure) are refused before anything starts.
#[test]
fn what_the_host_cannot_hold_is_a_usage_error() {
    for args in [
        &["bench", "p2p", "--block-sizes", "4k", "--total-bytes", "1024TiB"][..],
        &["bench", "p2p", "--batch-sizes", "100000000", "--max-request-bytes", "1024TiB"],
        &["demo", "--size", "1024TiB", "--block", "1GiB"],
    ] {
        let out = freight(args);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains("of host memory and") && err.contains("lower --"), "{args:?}: {err}");
    }
}

#[test]
fn blocks_larger_than_total_bytes_are_skipped() {
    let out =
        freight(&["bench", "p2p", "--total-bytes", "1MiB", "--iters", "1", "--warmup", "0", "--transport", "shm"]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(stdout.contains("note: skipped block sizes larger than --total-bytes 1 MiB: 2 MiB,"), "{stdout}");
}

#[test]
fn cache_engine_options_the_sender_would_refuse_stop_the_run_before_the_receiver_starts() {
    let out = freight(&["bench", "cache-engine", "--device", "cpu", "--num-chunks", "4", "--tier-size", "1k"]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--tier-size 1 KiB cannot hold one chunk"), "{err}");
    assert!(!err.contains("sender"), "the receiver never started: {err}");
}

#[test]
fn serve_names_the_option_or_file_it_refuses() {
    let out = freight(&["serve", "--memory-mb", "1", "--data-listen", "bogus"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("--data-listen 'bogus'"), "{}", text(&out.stderr));
    let junk = std::env::temp_dir().join(format!("freight-not-pem-{}.txt", std::process::id()));
    std::fs::write(&junk, "not a certificate\n").unwrap();
    let path = junk.to_str().unwrap();
    let out = freight(&["serve", "--memory-mb", "1", "--listen", "127.0.0.1:0", "--tls-cert", path, "--tls-key", path]);
    std::fs::remove_file(&junk).unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains(&format!("--tls-cert {path}: not a PEM file")), "{}", text(&out.stderr));
}

/// Logs that go to a file or a pipe carry no colour codes.
#[test]
fn logs_to_a_pipe_are_plain_text() {
    let out = Command::new(env!("CARGO_BIN_EXE_freight"))
        .args(["--log-level", "debug", "bench", "p2p", "--block-sizes", "4KiB", "--batch-sizes", "1", "--iters", "1"])
        .env_remove("NO_COLOR")
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("DEBUG"), "debug logs on stderr: {err}");
    assert!(!err.contains('\x1b'), "{err}");
}

/// The filter comes from --log-level, else FREIGHT_LOG, else RUST_LOG; a misspelt level
/// anywhere is a usage error naming where it came from; --log-format json (or
/// FREIGHT_LOG_FORMAT) writes one JSON object per line, in the target process too.
#[test]
fn log_levels_come_from_the_option_or_either_variable_and_json_is_one_object_a_line() {
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_freight"));
        cmd.args(args).env_remove("FREIGHT_LOG").env_remove("RUST_LOG").env_remove("FREIGHT_LOG_FORMAT");
        cmd.envs(env.iter().copied()).output().unwrap()
    };
    let p2p = ["bench", "p2p", "--block-sizes", "4KiB", "--batch-sizes", "1", "--iters", "1"];
    for (args, env, source) in [
        (vec!["--log-level=debg"], vec![], "--log-level 'debg'"),
        (vec![], vec![("FREIGHT_LOG", "debg")], "FREIGHT_LOG='debg'"),
        (vec![], vec![("RUST_LOG", "freight_core=loud")], "RUST_LOG='freight_core=loud'"),
        (vec![], vec![("FREIGHT_LOG_FORMAT", "yaml")], "FREIGHT_LOG_FORMAT: unknown log format 'yaml'"),
    ] {
        let out = run(&[args.as_slice(), &p2p].concat(), &env);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains(source), "{err}");
    }
    let out = run(&["--log-level=debg", "demo"], &[]);
    assert!(text(&out.stderr).contains("did you mean 'debug'"), "{}", text(&out.stderr));
    // RUST_LOG where FREIGHT_LOG is not set; FREIGHT_LOG first where both are.
    let out = run(&p2p, &[("RUST_LOG", "info")]);
    assert!(out.status.success() && text(&out.stderr).contains("INFO"), "{}", text(&out.stderr));
    let out = run(&p2p, &[("RUST_LOG", "info"), ("FREIGHT_LOG", "error")]);
    assert!(out.status.success() && !text(&out.stderr).contains("INFO"), "{}", text(&out.stderr));
    for (args, env) in [
        (vec!["--log-format", "json"], vec![("RUST_LOG", "info")]),
        (vec![], vec![("FREIGHT_LOG", "info"), ("FREIGHT_LOG_FORMAT", "JSON")]),
    ] {
        let out = run(&[args.as_slice(), &p2p].concat(), &env);
        let err = text(&out.stderr);
        assert!(out.status.success(), "{err}");
        let lines: Vec<serde_json::Value> =
            err.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"))).collect();
        assert!(lines.iter().all(|l| l["level"].is_string() && l["target"].is_string()), "{err}");
        // Both processes: the initiator's agent and the target's listen.
        let listening = lines.iter().filter(|l| l["fields"]["message"] == "listening").count();
        assert!(listening >= 2, "{err}");
    }
}

#[test]
fn engine_refusals_are_runtime_errors() {
    let out = freight(&["bench", "p2p", "--initiator-seg", "VRAM", "--block-sizes", "4KiB", "--batch-sizes", "1"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("VRAM"), "{}", text(&out.stderr));
}

#[test]
fn bench_descriptors_json() {
    let out = freight(&["bench", "descriptors", "--regions", "100", "--descriptors", "1024", "--reps", "2", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["copies_per_request"], 1024);
    assert!(doc["rows"].as_array().unwrap().len() >= 6);
}

#[test]
fn doctor_describes_this_machine_as_json_and_refuses_a_root_without_sysfs() {
    let out = freight(&["doctor", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).expect("doctor --json prints JSON");
    // Online CPUs: at least those this process may run on.
    let cpus = r["cpus"]["count"].as_u64().unwrap() as usize;
    assert!(cpus >= std::thread::available_parallelism().unwrap().get(), "{}", r["cpus"]);
    let nics = r["nics"].as_array().unwrap();
    assert!(nics.iter().any(|n| n["name"] == "lo"), "{nics:?}");
    // Without a GPU the report says why; with one it lists every GPU and a square matrix.
    if r["cuda"]["available"] == false {
        assert!(r["cuda"]["reason"].as_str().unwrap().contains("CUDA"), "{}", r["cuda"]);
        assert!(r["gpus"].as_array().unwrap().is_empty());
    } else {
        let gpus = r["gpus"].as_array().unwrap().len();
        assert!(gpus > 0);
        assert!(r["peer_access"].as_array().unwrap().iter().all(|row| row.as_array().unwrap().len() == gpus));
    }
    let fabric = &r["libfabric"];
    assert!(fabric["library"].is_string() || fabric["note"].as_str().unwrap().contains("not installed"), "{fabric}");
    // Providers offering GPU memory are among those offering RDMA.
    let providers = fabric["providers"].as_array().unwrap();
    assert!(fabric["gpu_memory_providers"].as_array().unwrap().iter().all(|p| providers.contains(p)), "{fabric}");

    let human = freight(&["doctor"]);
    assert!(human.status.success());
    for section in ["CPUs", "NUMA", "NICs", "CUDA", "libfabric"] {
        assert!(text(&human.stdout).contains(section), "no {section} in:\n{}", text(&human.stdout));
    }

    let empty = std::env::temp_dir().join(format!("freight-doctor-{}", std::process::id()));
    std::fs::create_dir_all(&empty).unwrap();
    let bad = freight(&["doctor", "--root", empty.to_str().unwrap()]);
    assert_eq!(bad.status.code(), Some(2), "{}", text(&bad.stderr));
    assert!(text(&bad.stderr).contains("no sys/ directory"));
    std::fs::remove_dir_all(&empty).unwrap();
}

/// Three processes write to each other at once; each reports its bandwidth, and each
/// checked what the other two wrote into it.
#[test]
fn a_full_mesh_of_three_processes_writes_and_checks() {
    let out = freight(&["bench", "p2p", "--full-mesh", "3", "--block-sizes", "1MiB", "--duration", "300ms", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let doc: serde_json::Value = serde_json::from_str(&text(&out.stdout)).unwrap();
    assert_eq!(doc["verified"], true, "{doc}");
    let results = doc["results"].as_array().unwrap();
    assert_eq!(results.len(), 3);
    for r in results {
        assert!(r["bytes"].as_u64().unwrap() >= 2 << 20, "{r}");
        assert!(r["errors"].as_array().unwrap().is_empty(), "{r}");
    }
    let total: f64 = results.iter().map(|r| r["gbps"].as_f64().unwrap()).sum();
    assert!((doc["total_gbps"].as_f64().unwrap() - total).abs() < 1e-9);
    let one = freight(&["bench", "p2p", "--full-mesh", "1"]);
    assert_eq!(one.status.code(), Some(2), "{}", text(&one.stderr));
    assert!(text(&one.stderr).contains("at least 2"), "{}", text(&one.stderr));
    // A member that cannot start its transfers fails the run, and the parent says which.
    let failing = Command::new(env!("CARGO_BIN_EXE_freight"))
        .args(["bench", "p2p", "--full-mesh", "2", "--mesh-memory", "host", "--block-sizes", "64KiB"])
        .env("FREIGHT_TRANSPORT", "cuda")
        .output()
        .unwrap();
    assert_eq!(failing.status.code(), Some(1));
    let err = text(&failing.stderr);
    assert!(err.contains("required transport cuda") && err.contains("mesh member"), "{err}");
}
