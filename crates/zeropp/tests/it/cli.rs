//! Runs the `zeropp` binary.

use std::process::Command;

fn zeropp() -> Command {
    Command::new(env!("CARGO_BIN_EXE_zeropp"))
}

#[test]
fn quant_default_runs() {
    let out = zeropp().arg("quant").output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("16777216 elements"), "{stdout}");
    assert!(stdout.contains("compression ratio: 3.9"), "{stdout}");
    assert!(stdout.contains("max abs error"), "{stdout}");
}

#[test]
fn quant_file_round_trip_with_output() {
    let dir = std::env::temp_dir().join(format!("zeropp-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let input = dir.join("x.f32");
    let wire = dir.join("x.zq");
    let x: Vec<u8> = (0..1000).flat_map(|i| (i as f32 / 10.0).to_le_bytes()).collect();
    std::fs::write(&input, x).unwrap();
    let out = zeropp()
        .args(["quant", "--bits", "4", "--group-size", "64", "--scheme", "asym", "--stochastic", "3"])
        .arg("--input")
        .arg(&input)
        .arg("--output")
        .arg(&wire)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let bytes = std::fs::read(&wire).unwrap();
    let q = zeropp_quant::QuantizedRef::from_bytes(&bytes).unwrap();
    assert_eq!(q.len(), 1000);
    std::fs::remove_dir_all(&dir).unwrap();
}

fn assert_one_line_failure(args: &[&str], needle: &str) {
    let out = zeropp().args(args).output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(needle), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn quant_bad_inputs_fail_cleanly() {
    assert_one_line_failure(
        &["quant", "--input", "/nonexistent/zeropp/input.f32"],
        "cannot read input file /nonexistent/zeropp/input.f32",
    );
    assert_one_line_failure(&["quant", "--random", "10", "--group-size", "0"], "group size 0");
    assert_one_line_failure(&["quant", "--random", "10", "--bits", "3"], "unsupported bit width 3");
    assert_one_line_failure(&["quant", "--random", "10", "--scheme", "x"], "unsupported quantization scheme");
}
