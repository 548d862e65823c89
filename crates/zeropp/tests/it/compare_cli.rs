//! `zeropp compare` end to end through the built binary: the table and the SVG plots.

use std::path::Path;
use std::process::Command;

#[test]
fn compare_prints_the_table_and_writes_both_plots() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("compare-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = Command::new(env!("CARGO_BIN_EXE_zeropp"))
        .args(["compare", "--model", "gpt-tiny", "--steps", "3", "--world", "4", "--local-size", "2"])
        .args(["--eval-batches", "1", "--link", "intra=100GB/s,inter=10GB/s,latency=1us", "--out"])
        .arg(&dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));

    // One table row per variant, ZeRO-3 first (the baseline of the ratios).
    let rows: Vec<&str> =
        stdout.lines().filter(|l| l.starts_with("| ") && !l.starts_with("| variant")).collect();
    let names: Vec<&str> = rows.iter().map(|r| r.split('|').nth(1).unwrap().trim()).collect();
    assert_eq!(names, ["zero3", "qwz", "hpz", "qgz", "zeropp"], "{stdout}");
    assert!(rows[0].ends_with("| 1.000x |"), "the baseline's inter-node ratio is not 1: {}", rows[0]);
    // ZeRO++ sends fewer inter-node bytes than ZeRO-3.
    let ratio: f64 = rows[4].rsplit('|').nth(1).unwrap().trim().trim_end_matches('x').parse().unwrap();
    assert!(ratio > 0.0 && ratio < 0.5, "zeropp inter-node ratio {ratio}: {stdout}");

    for name in ["loss.svg", "bytes.svg"] {
        let path = dir.join(name);
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(text.len() > 1000, "{} is only {} bytes", path.display(), text.len());
        let head = text.trim_start();
        assert!(head.starts_with("<svg") || head.starts_with("<?xml"), "{}: {}", path.display(), &text[..80]);
        assert!(text.trim_end().ends_with("</svg>"), "{} is truncated", path.display());
        assert!(stdout.contains(&format!("wrote {}", path.display())), "{stdout}");
    }
    // The legend of the loss plot names the variants.
    let loss = std::fs::read_to_string(dir.join("loss.svg")).unwrap();
    assert!(loss.contains("zero3") && loss.contains("zeropp"), "loss.svg lacks the variant legend");
    std::fs::remove_dir_all(&dir).unwrap();
}
