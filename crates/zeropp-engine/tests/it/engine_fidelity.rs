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
//!
//! A second check runs the **defaults** exactly as `zeropp train` does (the
//! default GPT on the generated text, 2 nodes × 4, the CLI's lr, 1500 steps) on
//! seeds 1-4 and applies the acceptance rule for a default: mean ratio to ZeRO-3
//! at most 1.01, no seed above 1.05. It is the check that would have caught the
//! LoCo defaults of issue 18 (their seed 4 is 1.07 here); the ignored test
//! [`the_old_defaults_fail_the_defaults_check`] shows it does.

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

/// The acceptance rule for a default: the mean ratio to ZeRO-3 over the seeds
/// at most this...
const RULE_MEAN: f64 = 1.01;
/// ...and no seed above this.
const RULE_WORST: f64 = 1.05;
/// The seeds of the defaults check.
const DEFAULT_SEEDS: [u64; 4] = [1, 2, 3, 4];

/// Per-seed ratios of `zero` to ZeRO-3, both run as `zeropp train --steps 1500
/// --seed S` runs them (TrainConfig::default: the default GPT on the generated
/// text, 2 nodes × 4, global batch 16, the CLI's learning rate, 4 validation
/// batches).
fn default_run_ratios(zero: ZeroConfig) -> Vec<f64> {
    let base = TrainConfig { steps: 1500, ..TrainConfig::default() };
    let val = |zero: ZeroConfig, seed: u64| -> f64 {
        let cfg = TrainConfig { engine: EngineConfig { zero, seed, ..base.engine.clone() }, ..base.clone() };
        let r = train(&cfg).unwrap();
        assert_eq!(r.summary.skipped_steps, 0);
        f64::from(r.summary.val_loss.unwrap())
    };
    DEFAULT_SEEDS.iter().map(|&s| val(zero, s) / val(ZeroConfig::zero3(), s)).collect()
}

/// Whether `ratios` meet the acceptance rule; with the mean and the worst seed.
fn meets_rule(ratios: &[f64]) -> (bool, f64, f64) {
    let mean = ratios.iter().sum::<f64>() / ratios.len() as f64;
    let worst = ratios.iter().cloned().fold(f64::MIN, f64::max);
    (mean <= RULE_MEAN && worst <= RULE_WORST, mean, worst)
}

/// The defaults (`ZeroConfig::zeropp`: stochastic rounding in qgZ, the 1-D
/// exclusion, no error feedback) meet the acceptance rule on the generated text
/// at the CLI's learning rate. No data file needed: the corpus is generated.
#[test]
fn the_defaults_meet_the_rule_on_the_generated_text() {
    let local = TrainConfig::default().local_size;
    let ratios = default_run_ratios(ZeroConfig::zeropp(local));
    let (ok, mean, worst) = meets_rule(&ratios);
    eprintln!(
        "defaults check (seeds {DEFAULT_SEEDS:?}): ratios {ratios:.4?}, mean {mean:.4}, worst {worst:.4}"
    );
    assert!(
        ok,
        "the defaults fail the rule (mean <= {RULE_MEAN}, every seed <= {RULE_WORST}): ratios {ratios:.4?}"
    );
}

/// The negative control of the check above: the defaults before issue 18 (LoCo
/// error feedback with f32 residuals, round to nearest, the 1-D exclusion) fail
/// it. Ignored in CI (another 8 training runs); `cargo test -p zeropp-engine
/// --release --test it -- --ignored the_old_defaults` runs it.
#[test]
#[ignore = "the negative control of the defaults check: 8 more training runs"]
fn the_old_defaults_fail_the_defaults_check() {
    use zeropp_engine::config::{CommDtype, LocoConfig};
    let local = TrainConfig::default().local_size;
    let mut old = QgzConfig::loco(ZeroConfig::default_qgz_spec());
    old.error_feedback = Some(LocoConfig { residual_dtype: CommDtype::F32, ..LocoConfig::default() });
    let ratios = default_run_ratios(ZeroConfig { qgz: Some(old), ..ZeroConfig::zeropp(local) });
    let (ok, mean, worst) = meets_rule(&ratios);
    eprintln!(
        "old defaults (seeds {DEFAULT_SEEDS:?}): ratios {ratios:.4?}, mean {mean:.4}, worst {worst:.4}"
    );
    assert!(!ok, "the old defaults passed the defaults check: ratios {ratios:.4?}");
}
