//! `zeropp plan`: the flags scripts rely on, the JSON's shape, the sweep and
//! the SVG, and the errors of bad flags.

use std::process::Command;

fn plan(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_zeropp")).arg("plan").args(args).output().unwrap()
}

const PAPER: &[&str] = &[
    "--params",
    "18e9",
    "--tokens",
    "2048",
    "--nodes",
    "24",
    "--gpus-per-node",
    "16",
    "--inter",
    "100Gbit/s",
    "--intra",
    "300GB/s",
    "--gpu",
    "v100",
    "--mode",
    "zero3,zeropp,zeropp-delta",
];

/// `--json` has a `modes` object keyed by mode name, each with at least
/// `step_s`, `tflops_per_gpu`, `inter_node_bytes` and `memory_bytes`; ZeRO++
/// sends under 0.3 of ZeRO-3's cross-node bytes and is not slower.
#[test]
fn json_has_every_mode_with_its_figures() {
    let out = plan(&[PAPER, &["--json"]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for mode in ["zero3", "zeropp", "zeropp-delta"] {
        let m = &v["modes"][mode];
        for key in ["step_s", "tflops_per_gpu", "inter_node_bytes", "memory_bytes"] {
            assert!(m[key].as_f64().is_some_and(|x| x.is_finite() && x > 0.0), "{mode}.{key}: {}", m[key]);
        }
    }
    let f = |mode: &str, key: &str| v["modes"][mode][key].as_f64().unwrap();
    assert!(f("zeropp", "inter_node_bytes") < 0.3 * f("zero3", "inter_node_bytes"));
    assert!(f("zeropp", "step_s") <= f("zero3", "step_s"));
    assert_eq!(v["gpus"].as_u64(), Some(384));
    assert!(v["flops_per_gpu"].as_f64().is_some_and(|x| x > 0.0), "flops_per_gpu: {}", v["flops_per_gpu"]);
    assert_eq!(f("zero3", "quantized_elements"), 0.0);
    assert!(f("zeropp", "quantized_elements") > 1e10, "ZeRO++ quantizes about three passes over 18e9");
}

/// A test model's megabytes print as such, not as 0.00 GB; a measured kernel
/// rate (`--gpu tflops=T,kernel=K`) slows only the modes that quantize.
#[test]
fn small_models_and_measured_kernel_rates() {
    let cpu = |kernel: &str| {
        let gpu = format!("tflops=0.02,kernel={kernel}");
        let out = plan(&[
            "--model",
            "gpt-medium",
            "--tokens",
            "32",
            "--nodes",
            "2",
            "--gpus-per-node",
            "2",
            "--inter",
            "50Mbit/s",
            "--intra",
            "10GB/s",
            "--gpu",
            &gpu,
            "--mode",
            "zero3,zeropp",
            // A rate measured on a whole step: every FLOP at it.
            "--compute-efficiency",
            "1",
            "--compute",
            "flat",
        ]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let table = cpu("3e8");
    assert!(table.contains("M parameters (3 blocks, width 256"), "{table}");
    assert!(!table.contains("| 0.00 |") && !table.contains("| 0.0 |"), "{table}");
    let step = |t: &str, mode: &str| -> f64 {
        let row = t.lines().find(|l| l.starts_with(&format!("| {mode} |"))).unwrap();
        row.split('|').nth(2).unwrap().trim().parse().unwrap()
    };
    // `--vocab` replaces a preset's vocabulary (as training replaces it with the
    // data's): per token less, one embedding row, one head row and its bias.
    let params = |extra: &[&str]| {
        let out = plan(&[&["--model", "gpt-medium", "--json"][..], extra].concat());
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["params"].as_i64().unwrap()
    };
    assert_eq!(params(&[]) - params(&["--vocab", "32"]), (2 * 256 + 1) * (64 - 32));
    let slow = cpu("3e6");
    assert_eq!(step(&table, "zero3"), step(&slow, "zero3"));
    assert!(step(&slow, "zeropp") > step(&table, "zeropp") + 0.1, "{table}\n{slow}");
}

/// The table names every mode, the sweep finds where the speedup crosses
/// 1.1x, and `--svg` writes a plot.
#[test]
fn table_sweep_and_svg() {
    let svg = std::env::temp_dir().join(format!("zeropp-plan-{}.svg", std::process::id()));
    let out = plan(&[PAPER, &["--sweep", "inter=10Gbps..800Gbps", "--svg", svg.to_str().unwrap()]].concat());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    for mode in ["| zero3 |", "| zeropp |", "| zeropp-delta |", "speedup >= 1.1x below"] {
        assert!(stdout.contains(mode), "{mode} missing:\n{stdout}");
    }
    let drawn = std::fs::read_to_string(&svg).unwrap();
    assert!(
        drawn.starts_with("<svg") && drawn.contains("zeropp-delta"),
        "{}",
        &drawn[..drawn.len().min(200)]
    );
    std::fs::remove_file(&svg).unwrap();
}

/// Compute follows the GEMM shapes by default: few tokens per GPU leave
/// tiles and waves of an H100's GEMMs idle, so a FLOP costs more than at
/// many; `--compute flat` prices every FLOP alike. The table says which.
#[test]
fn compute_follows_the_gemm_shapes() {
    let flop_s = |tokens: &str, compute: &str| {
        let out = plan(&[
            "--params",
            "1e9",
            "--seq",
            "2048",
            "--tokens",
            tokens,
            "--nodes",
            "2",
            "--gpus-per-node",
            "8",
            "--inter",
            "100Gbit/s",
            "--gpu",
            "h100",
            "--mode",
            "zero3",
            "--compute",
            compute,
            "--json",
        ]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert!(v["compute_model"].as_str().unwrap().starts_with(if compute == "flat" {
            "flat"
        } else {
            "GEMM shapes"
        }));
        v["flops_per_gpu"].as_f64().unwrap() / v["modes"]["zero3"]["compute_s"].as_f64().unwrap()
    };
    let (few, many) = (flop_s("64", "shapes"), flop_s("2048", "shapes"));
    assert!(few < 0.5 * many, "{few:e} FLOP/s at 64 tokens, {many:e} at 2048");
    let (few, many) = (flop_s("64", "flat"), flop_s("2048", "flat"));
    assert!((few / many - 1.0).abs() < 1e-9, "{few:e} against {many:e}");
    let table = String::from_utf8_lossy(&plan(&["--params", "1e9"]).stdout).into_owned();
    assert!(table.contains("compute: GEMM shapes, each tile at 0.5 of 989 TFLOP/s on 132 SMs"), "{table}");
}

#[test]
fn bad_flags_are_named() {
    for (args, says) in [
        (&["--inter", "100G"][..], "--inter: bandwidth `100G`"),
        (&["--compute-efficiency", "50"][..], "--compute-efficiency 50"),
        (&["--model", "gpt-medium", "--layers", "3"][..], "cannot be used with"),
        (&["--gpu", "b200"][..], "--gpu `b200`"),
        (&["--mode", "zero3,zero4"][..], "--mode `zero4`"),
        (&["--tokens", "3000"][..], "--tokens 3000"),
        (&["--sweep", "inter=9..8"][..], "--sweep"),
        (&["--overlap", "some"][..], "--overlap `some`"),
        (&["--compute", "fast"][..], "--compute `fast`: expected shapes"),
        (&["--overlap", "1.5"][..], "--overlap `1.5`: expected prefetch, none, or the exposed fraction"),
        (&["--gpu", "tflops=10,kernel=0"][..], "--gpu kernel"),
        (&["--gpu", "tflops=10"][..], "names no NVLink: give the intra-node rate with --intra"),
    ] {
        let out = plan(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(says), "{args:?}: {stderr}");
    }
}

/// Without `--intra` a plan runs at its GPU's own NVLink (an H100's 450 GB/s
/// each way, a V100's 150), as if `--intra` had said so; a rate given wins.
#[test]
fn the_intra_node_rate_follows_the_gpu() {
    let json = |args: &[&str]| -> serde_json::Value {
        let out = plan(&[&["--params", "7e9", "--nodes", "2", "--json"][..], args].concat());
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    for (gpu, rate, nvlink) in
        [("h100", "450GB/s", 450e9), ("v100", "150GB/s", 150e9), ("a100", "300GB/s", 300e9)]
    {
        let implied = json(&["--gpu", gpu]);
        assert_eq!(implied["intra_bytes_per_s"].as_f64(), Some(nvlink), "{gpu}");
        assert_eq!(implied["modes"], json(&["--gpu", gpu, "--intra", rate])["modes"], "{gpu}");
    }
    let given = json(&["--gpu", "h100", "--intra", "300GB/s"]);
    assert_eq!(given["intra_bytes_per_s"].as_f64(), Some(300e9));
    assert_ne!(given["modes"], json(&["--gpu", "h100"])["modes"]);
}
