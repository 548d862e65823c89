//! `zeropp train` end to end through the built binary: the metrics file, the
//! world-size independence of ZeRO-3 (f32), clean one-line failures on bad
//! inputs, and checkpoint save / resume.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

/// Runs `zeropp train` with `args` after the tiny-workload defaults
/// (`--model gpt-tiny --eval-batches 1`; later flags win in clap).
fn train(args: &[&str], extra: &[&Path]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_zeropp"))
        .args(["train", "--model", "gpt-tiny", "--eval-batches", "1"])
        .args(args)
        .args(extra)
        .output()
        .unwrap()
}

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("train-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn assert_success(out: &Output) {
    assert!(
        out.status.success(),
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The step objects and the summary object of a metrics file.
fn read_metrics(path: &Path) -> (Vec<Value>, serde_json::Map<String, Value>) {
    let text = std::fs::read_to_string(path).unwrap();
    let mut lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let last = lines.pop().expect("an empty metrics file");
    let summary =
        last.get("summary").and_then(Value::as_object).expect("last line is not {\"summary\": {..}}");
    (lines, summary.clone())
}

fn losses(steps: &[Value]) -> Vec<(u64, f64)> {
    steps.iter().map(|s| (s["step"].as_u64().unwrap(), s["loss"].as_f64().unwrap())).collect()
}

#[test]
fn metrics_file_has_one_record_per_step_then_a_summary() {
    let dir = scratch("metrics");
    let metrics = dir.join("m.jsonl");
    let out = train(&["--steps", "5", "--world", "4", "--local-size", "2", "--metrics"], &[&metrics]);
    assert_success(&out);
    let (steps, summary) = read_metrics(&metrics);
    assert_eq!(steps.len(), 5, "{steps:?}");
    for (i, s) in steps.iter().enumerate() {
        assert_eq!(s["step"].as_u64(), Some(i as u64), "{s}");
        let loss = s["loss"].as_f64().unwrap();
        assert!(loss.is_finite() && loss > 0.0, "{s}");
        assert!(s["step_time_s"].as_f64().unwrap() > 0.0, "{s}");
        let intra = s["intra_node_bytes"].as_f64().unwrap();
        let inter = s["inter_node_bytes"].as_f64().unwrap();
        // 2 nodes x 2: every step moves bytes on both link classes.
        assert!(intra > 0.0 && inter > 0.0, "{s}");
        assert_eq!(s["skipped"].as_bool(), Some(false), "{s}");
        let by_op = s["bytes_by_op"].as_object().unwrap();
        assert!(by_op.contains_key("fwd_gather") && by_op.contains_key("grad_reduce"), "{s}");
        let (mut sum_intra, mut sum_inter) = (0.0, 0.0);
        for (tag, v) in by_op {
            let (a, b) = (v["intra"].as_f64(), v["inter"].as_f64());
            assert!(a.is_some() && b.is_some(), "{tag}: {v}");
            sum_intra += a.unwrap();
            sum_inter += b.unwrap();
        }
        // The per-op figures add up to the per-class totals.
        assert!((sum_intra - intra).abs() <= 1e-6 * intra, "{s}");
        assert!((sum_inter - inter).abs() <= 1e-6 * inter, "{s}");
    }
    let last_loss = steps[4]["loss"].as_f64().unwrap();
    assert_eq!(summary["final_loss"].as_f64(), Some(last_loss), "{summary:?}");
    let val = summary["val_loss"].as_f64().unwrap();
    assert!(val.is_finite() && val > 0.0, "{summary:?}");
    assert_eq!(summary["steps"].as_u64(), Some(5));
    assert_eq!(summary["world"].as_u64(), Some(4));
    assert_eq!(summary["local_size"].as_u64(), Some(2));
    assert_eq!(summary["mode"].as_str(), Some("zeropp"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("metrics written to"), "{stdout}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn zero3_f32_losses_do_not_depend_on_the_world_size() {
    let dir = scratch("world");
    let run = |world: &str, local: &str, name: &str| {
        let metrics = dir.join(name);
        let out = train(
            &[
                "--steps",
                "4",
                "--seed",
                "7",
                "--mode",
                "zero3",
                "--comm-dtype",
                "f32",
                "--batch",
                "8",
                "--world",
                world,
                "--local-size",
                local,
                "--metrics",
            ],
            &[&metrics],
        );
        assert_success(&out);
        let (steps, summary) = read_metrics(&metrics);
        assert_eq!(summary["mode"].as_str(), Some("zero3"));
        assert_eq!(summary["world"].as_u64(), world.parse().ok());
        losses(&steps)
    };
    let one = run("1", "1", "w1.jsonl");
    let four = run("4", "2", "w4.jsonl");
    assert_eq!(one.len(), 4);
    assert_eq!(one.iter().map(|s| s.0).collect::<Vec<_>>(), four.iter().map(|s| s.0).collect::<Vec<_>>());
    for ((step, a), (_, b)) in one.iter().zip(&four) {
        assert!((a - b).abs() <= 1e-5 * a.abs(), "step {step}: world 1 loss {a} vs world 4 loss {b}");
    }
    // The runs trained (not a constant loss that trivially matches).
    assert!(one[3].1 < one[0].1, "{one:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Runs `zeropp train` with `args` and expects a non-zero exit with a one-line
/// error containing `needle` (case-insensitive) and no panic trace.
fn assert_one_line_failure(args: &[&str], extra: &[&Path], needle: &str) {
    let out = train(args, extra);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} succeeded\n{stderr}");
    assert!(!stderr.contains("panicked") && !stderr.contains("RUST_BACKTRACE"), "{args:?}: {stderr}");
    let lines: Vec<&str> = stderr.trim_end().lines().collect();
    assert_eq!(lines.len(), 1, "{args:?}: not one line:\n{stderr}");
    assert!(lines[0].starts_with("error: "), "{args:?}: {stderr}");
    assert!(lines[0].to_lowercase().contains(&needle.to_lowercase()), "{args:?}: `{needle}` not in {stderr}");
}

#[test]
fn bad_inputs_fail_with_one_line() {
    let dir = scratch("bad");
    assert_one_line_failure(
        &["--world", "6", "--local-size", "4"],
        &[],
        "world 6 is not divisible into nodes of 4",
    );
    assert_one_line_failure(
        &["--batch", "7", "--world", "4", "--local-size", "2"],
        &[],
        "global batch 7 is not divisible by world 4",
    );
    assert_one_line_failure(
        &["--data", "/nonexistent/zeropp.txt"],
        &[],
        "/nonexistent/zeropp.txt: No such file",
    );
    let empty = dir.join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    assert_one_line_failure(&["--world", "4", "--local-size", "2", "--data"], &[&empty], "empty text");
    let stage2 = dir.join("stage2.json");
    std::fs::write(&stage2, r#"{"train_batch_size": 16, "zero_optimization": {"stage": 2}}"#).unwrap();
    assert_one_line_failure(
        &["--world", "4", "--local-size", "2", "--config"],
        &[&stage2],
        "stage 2 is not supported",
    );
    let bad_type = dir.join("bad_type.json");
    std::fs::write(&bad_type, r#"{"gradient_clipping": "high"}"#).unwrap();
    assert_one_line_failure(
        &["--world", "4", "--local-size", "2", "--config"],
        &[&bad_type],
        "gradient_clipping",
    );
    let not_json = dir.join("not_json.json");
    std::fs::write(&not_json, "{ stage: 3 ").unwrap();
    assert_one_line_failure(
        &["--world", "4", "--local-size", "2", "--config"],
        &[&not_json],
        "not valid JSON",
    );
    assert_one_line_failure(&["--world", "4", "--local-size", "2", "--link", "intra=fast"], &[], "--link");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn resume_continues_the_trajectory_of_an_uninterrupted_run() {
    let dir = scratch("resume");
    let common = ["--world", "4", "--local-size", "2", "--seed", "3", "--metrics"];
    let (full, first, second, ckpt) =
        (dir.join("full.jsonl"), dir.join("first.jsonl"), dir.join("second.jsonl"), dir.join("ckpt"));

    let out = train(&[&["--steps", "6"][..], &common].concat(), &[&full]);
    assert_success(&out);
    let out = train(&[&["--steps", "3"][..], &common].concat(), &[&first, Path::new("--save"), &ckpt]);
    assert_success(&out);
    let out = train(&[&["--steps", "6"][..], &common].concat(), &[&second, Path::new("--resume"), &ckpt]);
    assert_success(&out);

    let full = losses(&read_metrics(&full).0);
    let first = losses(&read_metrics(&first).0);
    let (second_steps, second_summary) = read_metrics(&second);
    let second = losses(&second_steps);
    assert_eq!(full.len(), 6);
    assert_eq!(first.len(), 3);
    // The resumed run reports only the steps it ran: 3, 4, 5.
    assert_eq!(second.iter().map(|s| s.0).collect::<Vec<_>>(), vec![3, 4, 5], "{second:?}");
    let resumed: Vec<(u64, f64)> = first.iter().chain(&second).copied().collect();
    for ((step, a), (_, b)) in full.iter().zip(&resumed) {
        assert!((a - b).abs() <= 1e-6 * a.abs(), "step {step}: uninterrupted {a} vs save/resume {b}");
    }
    assert_eq!(second_summary["final_loss"].as_f64(), Some(full[5].1));
    std::fs::remove_dir_all(&dir).unwrap();
}
