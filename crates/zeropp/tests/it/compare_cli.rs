//! `zeropp compare` end to end through the built binary: the table (every ratio
//! against hierarchical ZeRO-3, flat ZeRO-3 beside it) and the SVG plots.

use std::path::Path;
use std::process::Command;

/// The table of `stdout`: its header cells and its rows' cells.
fn table(stdout: &str) -> (Vec<String>, Vec<Vec<String>>) {
    let cells = |l: &str| -> Vec<String> {
        let l = l.trim().trim_start_matches('|').trim_end_matches('|');
        l.split('|').map(|c| c.trim().to_string()).collect()
    };
    let header = stdout.lines().find(|l| l.starts_with("| variant")).map(cells).unwrap_or_default();
    let rows =
        stdout.lines().filter(|l| l.starts_with("| ") && !l.starts_with("| variant")).map(cells).collect();
    (header, rows)
}

/// The cell of `row` under the header `name`.
fn cell<'a>(header: &[String], row: &'a [String], name: &str) -> &'a str {
    let i =
        header.iter().position(|h| h == name).unwrap_or_else(|| panic!("no column `{name}` in {header:?}"));
    &row[i]
}

/// A ratio cell (`0.250x`).
fn ratio(s: &str) -> f64 {
    s.trim_end_matches('x').parse().unwrap_or_else(|e| panic!("`{s}` is not a ratio: {e}"))
}

#[test]
fn compare_prints_the_table_and_writes_the_plots() {
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

    // One table row per variant: hierarchical ZeRO-3 first (the baseline of the
    // ratios), flat ZeRO-3 beside it.
    let (header, rows) = table(&stdout);
    let names: Vec<&str> = rows.iter().map(|r| cell(&header, r, "variant")).collect();
    assert_eq!(names, ["zero3", "zero3-flat", "qwz", "hpz", "qgz", "zeropp", "zeropp-delta"], "{stdout}");
    let routing: Vec<&str> = rows.iter().map(|r| cell(&header, r, "routing")).collect();
    assert_eq!(
        routing,
        [
            "hierarchical",
            "flat",
            "hierarchical",
            "hierarchical",
            "hierarchical",
            "hierarchical",
            "hierarchical"
        ]
    );
    let (zero3, flat, zeropp, delta) = (&rows[0], &rows[1], &rows[5], &rows[6]);
    let inter_vs = "inter-node vs zero3";
    let inter_vs_flat = "inter-node vs zero3-flat";
    assert_eq!(
        cell(&header, zero3, inter_vs),
        "1.000x",
        "the baseline's inter-node ratio is not 1: {stdout}"
    );
    assert_eq!(cell(&header, flat, inter_vs_flat), "1.000x", "{stdout}");
    assert_eq!(cell(&header, zero3, "speedup vs zero3"), "1.00x", "{stdout}");

    // On 2 nodes, flat routing sends more across nodes than hierarchical routing
    // (each rank reaches every remote rank, not only its rail peer).
    let mb = |row: &[String]| -> f64 { cell(&header, row, "inter-node MB/rank/step").parse().unwrap() };
    assert!(mb(flat) > mb(zero3), "flat {} MB vs hierarchical {} MB: {stdout}", mb(flat), mb(zero3));
    assert!(ratio(cell(&header, flat, inter_vs)) > 1.0, "{stdout}");

    // ZeRO++ sends fewer inter-node bytes than either ZeRO-3, and its ratio
    // against the fair (hierarchical) baseline is the larger one.
    let (fair, vs_flat) =
        (ratio(cell(&header, zeropp, inter_vs)), ratio(cell(&header, zeropp, inter_vs_flat)));
    assert!(fair > 0.0 && fair < 0.5, "zeropp inter-node ratio {fair}: {stdout}");
    assert!(vs_flat < fair, "zeropp vs flat {vs_flat} is not below zeropp vs hierarchical {fair}: {stdout}");
    // zeropp-delta's difference steps keep the forward gather in the node: over
    // the run (its first step is a full refresh) it sends less than ZeRO++.
    let delta_fair = ratio(cell(&header, delta, inter_vs));
    assert!(delta_fair > 0.0 && delta_fair < fair, "zeropp-delta {delta_fair} vs zeropp {fair}: {stdout}");
    for row in &rows {
        ratio(cell(&header, row, "speedup vs zero3"));
        ratio(cell(&header, row, "speedup vs zero3-flat"));
    }

    for name in ["loss.svg", "bytes.svg", "ratios.svg"] {
        let path = dir.join(name);
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(text.len() > 1000, "{} is only {} bytes", path.display(), text.len());
        let head = text.trim_start();
        assert!(head.starts_with("<svg") || head.starts_with("<?xml"), "{}: {}", path.display(), &text[..80]);
        assert!(text.trim_end().ends_with("</svg>"), "{} is truncated", path.display());
        assert!(stdout.contains(&format!("wrote {}", path.display())), "{stdout}");
    }
    // The legend of the loss plot names the variants; the ratio plot names both baselines.
    let loss = std::fs::read_to_string(dir.join("loss.svg")).unwrap();
    assert!(
        loss.contains("zero3") && loss.contains("zero3-flat") && loss.contains("zeropp"),
        "loss.svg legend"
    );
    let ratios = std::fs::read_to_string(dir.join("ratios.svg")).unwrap();
    assert!(ratios.contains("vs zero3-flat") && ratios.contains("vs zero3"), "ratios.svg legend");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `compare` runs every built-in model, the candle Llama included: asked for
/// the Llama it compares the Llama (named, with its parameter count, above the
/// table), not the default GPT under the Llama's name.
#[test]
fn compare_runs_the_candle_llama() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("compare-llama-{}", std::process::id()));
    let spec = "llama:d=16,layers=1,heads=2,kv_heads=1,seq=16";
    let out = Command::new(env!("CARGO_BIN_EXE_zeropp"))
        .args(["compare", "--model", spec, "--steps", "1", "--world", "4", "--local-size", "2"])
        .args(["--no-ablation", "--eval-batches", "0", "--out"])
        .arg(&dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let line = stdout.lines().find(|l| l.starts_with("model ")).unwrap_or_default();
    assert!(line.starts_with("model llama ("), "{stdout}");
    let (_, rows) = table(&stdout);
    assert_eq!(rows.len(), 4, "{stdout}");
    let _ = std::fs::remove_dir_all(&dir);
}
