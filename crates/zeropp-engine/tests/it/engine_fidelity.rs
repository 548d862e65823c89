//! Fidelity: ZeRO++ (qwZ INT8 + hpZ + qgZ INT4) converges like ZeRO-3 (bf16) on
//! real text. A small character GPT on tinyshakespeare for CI; the full-size
//! comparison (`GptConfig::default_small`, 2 nodes x 4) is in the e2e bench.
//! The text is `../shared/data/tinyshakespeare.txt` (found by `zeropp_tests::data`).

use std::time::Instant;

use zeropp_engine::config::{AdamWConfig, EngineConfig, ZeroConfig};
use zeropp_engine::model::GptConfig;
use zeropp_engine::train::{DataChoice, ModelChoice, TrainConfig, load_data, train};
use zeropp_tests::data::{TINYSHAKESPEARE, require};

/// Measured (2 nodes x 2, 300 steps, lr 5e-3): val loss ~2.28-2.30 from ln(65) = 4.17;
/// ZeRO++ / ZeRO-3 - 1 = +0.99% here. Nearby settings gave +0.2% to +1.2% over
/// seeds 0-2 and ~+0.9% at 500 steps (a small systematic cost of INT4 qgZ), so
/// the 2% bound holds with about 2x margin. About 10 s on 2 cores.
#[test]
fn zeropp_val_loss_within_two_percent_of_zero3() {
    // Absent data fails under CI=true (or ZEROPP_REQUIRE_DATA=1), else skips with a counted line.
    let Some(path) = require(TINYSHAKESPEARE, "zeropp_val_loss_within_two_percent_of_zero3") else {
        return;
    };
    let base = TrainConfig {
        // The vocabulary (65 characters) is set from the data.
        model: ModelChoice::Gpt(GptConfig {
            seq_len: 32,
            d_model: 32,
            n_head: 2,
            n_layer: 2,
            ..GptConfig::tiny()
        }),
        data: DataChoice::File(path),
        world: 4,
        local_size: 2,
        engine: EngineConfig {
            global_batch: 32,
            optim: AdamWConfig { lr: 5e-3, ..AdamWConfig::default() },
            seed: 0,
            ..EngineConfig::default()
        },
        steps: 300,
        eval_batches: 16,
        ..TrainConfig::default()
    };
    let vocab = load_data(&base.data).unwrap().1.vocab;
    let uniform = (vocab as f32).ln();
    let run = |zero: ZeroConfig| {
        let t = Instant::now();
        let report =
            train(&TrainConfig { engine: EngineConfig { zero, ..base.engine.clone() }, ..base.clone() })
                .unwrap();
        assert_eq!(report.summary.steps, base.steps);
        assert_eq!(report.summary.skipped_steps, 0);
        (report.summary.val_loss.unwrap(), t.elapsed())
    };
    let (z3, t3) = run(ZeroConfig::zero3());
    let (zpp, tpp) = run(ZeroConfig::zeropp(base.local_size));
    let gap = zpp / z3 - 1.0;
    eprintln!(
        "char GPT, tinyshakespeare, {} steps on {} x {}: val loss zero3 {z3:.4} ({t3:.1?}), zeropp {zpp:.4} \
         ({tpp:.1?}), zeropp/zero3 - 1 = {:+.2}% (uniform ln({vocab}) = {uniform:.3})",
        base.steps,
        base.world / base.local_size,
        base.local_size,
        gap * 100.0
    );
    // Both learned: well below the uniform prediction (and past a unigram model, ~3.3).
    for (name, v) in [("zero3", z3), ("zeropp", zpp)] {
        assert!(v < 0.65 * uniform, "{name} did not learn: val loss {v} vs ln(vocab) {uniform}");
    }
    // ZeRO++ is within 2% of ZeRO-3.
    assert!(gap.abs() <= 0.02, "zeropp val loss {zpp} vs zero3 {z3}: {:+.2}%", gap * 100.0);
}
