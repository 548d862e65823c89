//! Fidelity: ZeRO++ converges like ZeRO-3 (bf16), judged as a mean over seeds
//! in a **calm regime** (ZeRO-3's own seed-to-seed spread a few percent), with
//! the **two-sided** rule of `zeropp_tests::fidelity::CALM`: the mean ratio
//! `val_loss(ZeRO++) / val_loss(ZeRO-3)` within [0.97, 1.01], every seed within
//! [0.94, 1.03]. ZeRO++ far *better* than ZeRO-3 fails too: it would mean the
//! check measures luck (at the old lr 1e-2 this check passed at a mean of 0.912).
//!
//! Two checks, each with a negative control that CI runs:
//!
//! - **the defaults** (`ZeroConfig::zeropp`) on `zeropp train`'s data,
//!   topology, lr and steps (the generated text, 2 nodes × 4, lr 3e-3, 1500
//!   steps) on a smaller GPT ([`control_run`]), seeds 1-4; the control runs
//!   INT4 instead of INT8 weights in qwZ through the same rule on the same run
//!   and must fail it **on the mean**. The default GPT (112k parameters) is
//!   judged by the bench below (8 runs of it here took most of CI's test time).
//! - **tinyshakespeare** (`../shared/data/tinyshakespeare.txt`, found by
//!   `zeropp_tests::data`): a small GPT on 2 × 2; its control, a coarse qgZ (one
//!   INT4 scale per 8192 values straddling tensors), must fail.
//!
//! The full protocol (3 corpora × 8 seeds) is `cargo xtask bench fidelity`.

use std::path::Path;
use std::sync::OnceLock;
use zeropp_engine::RunConfig;

use zeropp_engine::config::{AdamWConfig, EngineConfig, QgzConfig, ZeroConfig, quant_spec};
use zeropp_engine::data::{DataChoice, load_data};
use zeropp_engine::model::GptConfig;
use zeropp_run::train::{ModelChoice, TrainConfig, train};
use zeropp_tests::data::{TINYSHAKESPEARE, require};
use zeropp_tests::fidelity::{CALM, Judged, ratios};

/// The seeds every run of this file uses; the rule applies to the ratios over them.
const SEEDS: [u64; 4] = [1, 2, 3, 4];

/// Final validation loss of `cfg` with `zero` and `seed` (no skipped step).
fn val_loss(cfg: &TrainConfig, zero: ZeroConfig, seed: u64) -> f64 {
    let mut cfg = cfg.clone();
    (cfg.run.engine.zero, cfg.run.engine.seed) = (zero, seed);
    let r = train(&cfg).unwrap();
    assert_eq!(r.summary.steps, cfg.run.steps);
    assert_eq!(r.summary.skipped_steps, 0, "{}: seed {seed}", zero.label());
    f64::from(r.summary.val_loss.unwrap())
}

/// Validation losses of `zero` on `cfg` over [`SEEDS`].
fn val_losses(cfg: &TrainConfig, zero: ZeroConfig) -> Vec<f64> {
    SEEDS.iter().map(|&s| val_loss(cfg, zero, s)).collect()
}

/// ZeRO-3's losses on `cfg`, computed once per process and `slot` (the checks
/// and their controls run in parallel threads of one test binary).
fn zero3_once(slot: &'static OnceLock<Vec<f64>>, cfg: &TrainConfig) -> &'static [f64] {
    slot.get_or_init(|| val_losses(cfg, ZeroConfig::zero3()))
}

/// The rule's verdict on `variant` against ZeRO-3 (`baseline`), printed.
fn judged(what: &str, variant: &[f64], baseline: &[f64]) -> Judged {
    let j = CALM.judge(&ratios(variant, baseline));
    eprintln!("fidelity, {what} (seeds {SEEDS:?}): {j}");
    j
}

/// Where the defaults and their negative control run: `zeropp train`'s data,
/// topology, global batch and lr ([`TrainConfig::default`]) for 1500 steps on
/// a smaller GPT (d 32, 2 layers, seq 32: 29k parameters; CI time). ZeRO-3's
/// spread is 1.3% over 8 seeds there (calm). On seeds 1-4 the defaults score
/// 1.004 ± 0.008 and INT4 qwZ weights 1.189 ± 0.010. (Before the GPT's LM
/// head was stored `[vocab, d]`, the control was the LoCo defaults of old,
/// which scored 1.026 here; with the head's groups inside a token's row they
/// score 0.991 ± 0.012, as do a round-to-nearest qgZ without the 1-D
/// exclusion, 0.998, and a coarse qgZ of one scale per 8192 values, 0.994:
/// this run is too noisy to tell those from the defaults, so the control is
/// a defect it can see.)
fn control_run() -> TrainConfig {
    let gpt = GptConfig { d_model: 32, n_head: 2, n_layer: 2, seq_len: 32, ..GptConfig::default_small() };
    let d = TrainConfig::default();
    TrainConfig { model: ModelChoice::Gpt(gpt), run: d.run.with_steps(1500), ..d }
}

static CONTROL_ZERO3: OnceLock<Vec<f64>> = OnceLock::new();

/// The defaults meet the two-sided rule on the generated text at the default
/// lr (no data file needed: the corpus is generated), and, as the negative
/// control, INT4 weights in qwZ (the seeded defect `qwz-int4` of the torch
/// checks) fail the same rule on the mean on the same run ([`control_run`]):
/// the rule, not the run, is what tells them apart.
#[test]
fn the_defaults_meet_the_rule_and_int4_weights_fail_it_on_the_mean() {
    let run = control_run();
    let z3 = zero3_once(&CONTROL_ZERO3, &run);
    let local = run.run.local_size;
    let int4 = ZeroConfig::zeropp(local).with_qwz(quant_spec("qwZ", 4, 256).unwrap());
    let bad = judged("INT4 qwZ weights (control run)", &val_losses(&run, int4), z3);
    assert!(bad.mean_broken(), "INT4 qwZ weights passed the mean bound: {bad}");
    let new = judged("defaults (control run)", &val_losses(&run, ZeroConfig::zeropp(local)), z3);
    assert!(new.passed(), "the defaults fail the rule on the control run: {new}");
}

/// The small GPT on tinyshakespeare on 2 × 2 (vocabulary from the data).
fn shakespeare_run(path: &Path) -> TrainConfig {
    TrainConfig {
        model: ModelChoice::Gpt(GptConfig {
            seq_len: 32,
            d_model: 32,
            n_head: 2,
            n_layer: 2,
            ..GptConfig::tiny()
        }),
        data: DataChoice::File(path.to_path_buf()),
        run: RunConfig {
            world: 4,
            local_size: 2,
            engine: EngineConfig {
                global_batch: 32,
                optim: AdamWConfig { lr: 5e-3, ..AdamWConfig::default() },
                ..EngineConfig::default()
            },
            steps: 300,
            eval_batches: 16,
            ..RunConfig::default()
        },
    }
}

static SHAKESPEARE_ZERO3: OnceLock<Vec<f64>> = OnceLock::new();

/// ZeRO-3's tinyshakespeare losses, which also learned (well below the uniform
/// prediction, and past a unigram model, ~3.3).
fn shakespeare_zero3(run: &TrainConfig) -> &'static [f64] {
    let z3 = zero3_once(&SHAKESPEARE_ZERO3, run);
    let uniform = (load_data(&run.data).unwrap().1.vocab as f64).ln();
    assert!(z3.iter().all(|&v| v < 0.65 * uniform), "ZeRO-3 did not learn: {z3:?} vs ln(vocab) {uniform}");
    z3
}

/// The tinyshakespeare run and ZeRO-3's losses on it, or `None` (a counted
/// skip line; a failure under CI=true or ZEROPP_REQUIRE_DATA=1) without the data.
fn shakespeare(test: &str) -> Option<(TrainConfig, &'static [f64])> {
    let path = require(TINYSHAKESPEARE, test)?;
    let run = shakespeare_run(&path);
    let z3 = shakespeare_zero3(&run);
    Some((run, z3))
}

/// ZeRO++ with SDP4Bit's techniques (`ZeroConfig::zeropp_delta`: qwZ-Δ's INT4
/// weight differences into the hpZ copies, two-level qgZ with Hadamard
/// smoothing) meets the same rule on the same run. This is the check that
/// catches a rotation not undone (the gradients come back rotated) and copies
/// that drift from their owners' `Ŵ` (the forward uses weights nobody
/// optimises), each of which trains measurably worse here.
#[test]
fn zeropp_delta_meets_the_rule_on_tinyshakespeare() {
    let Some((run, z3)) = shakespeare("zeropp_delta_meets_the_rule_on_tinyshakespeare") else { return };
    let j = judged("tinyshakespeare, zeropp-delta", &val_losses(&run, ZeroConfig::zeropp_delta(2)), z3);
    assert!(j.passed(), "zeropp-delta fails the rule on tinyshakespeare: {j}");
}

#[test]
fn zeropp_meets_the_rule_on_tinyshakespeare() {
    let Some((run, z3)) = shakespeare("zeropp_meets_the_rule_on_tinyshakespeare") else { return };
    let j = judged("tinyshakespeare", &val_losses(&run, ZeroConfig::zeropp(2)), z3);
    assert!(j.passed(), "ZeRO++ fails the rule on tinyshakespeare: {j}");
}

/// The negative control: qgZ with one INT4 scale per 8192 values, groups
/// straddling tensors and no error feedback, rounds most gradient entries to
/// zero; the same rule must reject it on the mean.
#[test]
fn the_rule_rejects_a_coarse_qgz() {
    let Some((run, z3)) = shakespeare("the_rule_rejects_a_coarse_qgz") else { return };
    let coarse = ZeroConfig {
        qgz: Some(QgzConfig::plain(quant_spec("qgZ", 4, 8192).unwrap())),
        per_tensor_groups: false,
        ..ZeroConfig::zeropp(2)
    };
    let j = judged("coarse qgZ (control)", &val_losses(&run, coarse), z3);
    assert!(j.mean_broken(), "a coarse qgZ passed the mean bound: {j}");
}
