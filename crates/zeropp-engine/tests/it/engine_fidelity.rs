//! Fidelity: ZeRO++ (qwZ INT8 + hpZ + qgZ INT4, default options) converges like
//! ZeRO-3 (bf16) on real text, as a mean over seeds: one seed proves nothing at
//! this scale (the fidelity bench measures ZeRO-3 f32 against ZeRO-3 bf16 at
//! ±3% per seed). A small character GPT on tinyshakespeare, 2 nodes × 2, for
//! CI; the full comparison (default GPT, 2 × 4, more seeds and variants) is
//! `cargo xtask bench fidelity` (docs/PERFORMANCE.md).
//!
//! The check stays real: the same budget rejects a deliberately coarse qgZ (one
//! INT4 scale for 8192 gradient values straddling tensors), see
//! [`the_budget_rejects_a_coarse_qgz`].
//! The text is `../shared/data/tinyshakespeare.txt` (found by `zeropp_tests::data`).

use std::path::Path;

use zeropp_engine::config::{AdamWConfig, EngineConfig, QgzConfig, ZeroConfig, quant_spec};
use zeropp_engine::model::GptConfig;
use zeropp_engine::train::{DataChoice, ModelChoice, TrainConfig, load_data, train};
use zeropp_tests::data::{TINYSHAKESPEARE, require};

/// The seeds every variant runs; the budget applies to the mean ratio over them.
const SEEDS: [u64; 3] = [1, 2, 3];

/// Mean over [`SEEDS`] of val_loss(variant) / val_loss(ZeRO-3 bf16) may exceed 1 by
/// at most this. Measured (300 steps, lr 5e-3): default ZeRO++ 0.995-1.005 over
/// seeds 1-3; the coarse-qgZ control 1.03-1.05 (see the module docs).
const BUDGET: f64 = 0.015;

/// Final validation losses of `zero` for every seed of [`SEEDS`].
fn val_losses(path: &Path, zero: ZeroConfig) -> Vec<f64> {
    let base = TrainConfig {
        // The vocabulary (65 characters) is set from the data.
        model: ModelChoice::Gpt(GptConfig {
            seq_len: 32,
            d_model: 32,
            n_head: 2,
            n_layer: 2,
            ..GptConfig::tiny()
        }),
        data: DataChoice::File(path.to_path_buf()),
        world: 4,
        local_size: 2,
        engine: EngineConfig {
            global_batch: 32,
            optim: AdamWConfig { lr: 5e-3, ..AdamWConfig::default() },
            ..EngineConfig::default()
        },
        steps: 300,
        eval_batches: 16,
        ..TrainConfig::default()
    };
    let uniform = (load_data(&base.data).unwrap().1.vocab as f64).ln();
    SEEDS
        .iter()
        .map(|&seed| {
            let cfg =
                TrainConfig { engine: EngineConfig { zero, seed, ..base.engine.clone() }, ..base.clone() };
            let r = train(&cfg).unwrap();
            assert_eq!(r.summary.steps, base.steps);
            assert_eq!(r.summary.skipped_steps, 0);
            let v = f64::from(r.summary.val_loss.unwrap());
            // It learned: well below the uniform prediction (and past a unigram model, ~3.3).
            assert!(v < 0.65 * uniform, "{} seed {seed}: val loss {v} vs ln(vocab) {uniform}", zero.label());
            v
        })
        .collect()
}

/// The mean ratio of `variant` to `baseline` over the seeds, and the per-seed ratios.
fn mean_ratio(variant: &[f64], baseline: &[f64]) -> (f64, Vec<f64>) {
    let r: Vec<f64> = variant.iter().zip(baseline).map(|(a, b)| a / b).collect();
    (r.iter().sum::<f64>() / r.len() as f64, r)
}

#[test]
fn zeropp_val_loss_within_budget_of_zero3_over_seeds() {
    // Absent data fails under CI=true (or ZEROPP_REQUIRE_DATA=1), else skips with a counted line.
    let Some(path) = require(TINYSHAKESPEARE, "zeropp_val_loss_within_budget_of_zero3_over_seeds") else {
        return;
    };
    let z3 = val_losses(&path, ZeroConfig::zero3());
    let zpp = val_losses(&path, ZeroConfig::zeropp(2));
    let (mean, per_seed) = mean_ratio(&zpp, &z3);
    eprintln!(
        "fidelity (seeds {SEEDS:?}): zero3 {z3:.4?}, zeropp {zpp:.4?}, ratios {per_seed:.4?}, mean {mean:.4}"
    );
    assert!(
        mean <= 1.0 + BUDGET,
        "zeropp / zero3 = {mean:.4} over seeds {SEEDS:?} (per seed {per_seed:.4?})"
    );
    // Better than ZeRO-3 by a wide margin would be as suspicious as worse.
    assert!(mean >= 1.0 - 3.0 * BUDGET, "zeropp / zero3 = {mean:.4}: implausibly better");
}

/// The negative control: the budget above is able to fail. qgZ with one INT4
/// scale per 8192 values, groups straddling tensors and no error feedback rounds
/// most gradient entries to zero; the same check must reject it.
#[test]
fn the_budget_rejects_a_coarse_qgz() {
    let Some(path) = require(TINYSHAKESPEARE, "the_budget_rejects_a_coarse_qgz") else {
        return;
    };
    let z3 = val_losses(&path, ZeroConfig::zero3());
    let coarse = ZeroConfig {
        qgz: Some(QgzConfig::plain(quant_spec("qgZ", 4, 8192).unwrap())),
        per_tensor_groups: false,
        ..ZeroConfig::zeropp(2)
    };
    let (mean, per_seed) = mean_ratio(&val_losses(&path, coarse), &z3);
    eprintln!("fidelity control (coarse qgZ): ratios {per_seed:.4?}, mean {mean:.4}");
    assert!(
        mean > 1.0 + BUDGET,
        "a coarse qgZ passed the fidelity budget: {mean:.4} (per seed {per_seed:.4?})"
    );
}
