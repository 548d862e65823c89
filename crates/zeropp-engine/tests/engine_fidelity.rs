//! Fidelity: ZeRO++ (qwZ INT8 + hpZ + qgZ INT4) converges like ZeRO-3 (bf16) on
//! real text. A small budget for CI; the full-size comparison is in the e2e bench.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may unwrap

use std::path::PathBuf;

use zeropp_engine::config::{AdamWConfig, EngineConfig, ZeroConfig};
use zeropp_engine::model::MlpConfig;
use zeropp_engine::train::{DataChoice, ModelChoice, TrainConfig, train};

fn shakespeare() -> Option<PathBuf> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/tinyshakespeare.txt");
    p.exists().then_some(p)
}

#[test]
fn zeropp_val_loss_within_two_percent_of_zero3() {
    let Some(path) = shakespeare() else {
        eprintln!("skipping: ../shared/data/tinyshakespeare.txt (relative to the workspace root) is absent");
        return;
    };
    let base = TrainConfig {
        model: ModelChoice::Mlp(MlpConfig::default_small()),
        data: DataChoice::File(path),
        world: 8,
        local_size: 4,
        engine: EngineConfig {
            global_batch: 32,
            optim: AdamWConfig { lr: 1e-2, ..AdamWConfig::default() },
            ..EngineConfig::default()
        },
        steps: 150,
        eval_batches: 8,
        ..TrainConfig::default()
    };
    let z3 = train(&TrainConfig {
        engine: EngineConfig { zero: ZeroConfig::zero3(), ..base.engine.clone() },
        ..base.clone()
    })
    .unwrap();
    let zpp = train(&TrainConfig {
        engine: EngineConfig { zero: ZeroConfig::zeropp(4), ..base.engine.clone() },
        ..base.clone()
    })
    .unwrap();
    let (a, b) = (z3.summary.val_loss.unwrap(), zpp.summary.val_loss.unwrap());
    eprintln!(
        "val loss after {} steps: zero3 {a:.4}, zeropp {b:.4} (init ~ {:.3})",
        base.steps, z3.steps[0].loss
    );
    // It learned something...
    assert!(a < 0.8 * z3.steps[0].loss, "zero3 did not learn: {a}");
    // ... and ZeRO++ is within 2% of ZeRO-3.
    assert!((b - a).abs() / a <= 0.02, "zeropp {b} vs zero3 {a}");
}
