//! Measured bytes per rank per step equal the analytic model exactly, and
//! ZeRO++ cuts cross-node bytes to at most a quarter of ZeRO-3's on 2 nodes x 4.

use zeropp_engine::config::{CommDtype, EngineConfig, ZeroConfig};
use zeropp_engine::model::{GptConfig, MlpConfig};
use zeropp_engine::train::{DataChoice, ModelChoice, TrainConfig, train};

fn run(world: usize, local: usize, zero: ZeroConfig, accum: usize, model: ModelChoice) -> TrainConfig {
    TrainConfig {
        model,
        data: DataChoice::Markov { seed: 5, chars: 30_000 },
        world,
        local_size: local,
        engine: EngineConfig {
            zero,
            global_batch: world * accum,
            grad_accum: accum,
            ..EngineConfig::default()
        },
        steps: 3,
        eval_batches: 0,
        ..TrainConfig::default()
    }
}

#[test]
fn measured_bytes_equal_the_analytic_model() {
    let tiny = ModelChoice::Gpt(GptConfig::tiny());
    let mlp = ModelChoice::Mlp(MlpConfig::tiny());
    let z3 = ZeroConfig::zero3();
    let mut cases = vec![];
    for (w, l) in [(8, 4), (4, 2), (4, 1), (4, 4), (2, 1)] {
        let hpz = l;
        cases.push((w, l, z3));
        cases.push((w, l, ZeroConfig { comm_dtype: CommDtype::F32, ..z3 }));
        cases.push((w, l, ZeroConfig::zeropp(hpz)));
        cases.push((w, l, ZeroConfig { qwz: true, ..z3 }));
        cases.push((w, l, ZeroConfig { hpz_size: hpz, ..z3 }));
        cases.push((w, l, ZeroConfig { qgz: true, ..z3 }));
    }
    cases.push((8, 4, ZeroConfig { hpz_size: 2, qwz_bits: 4, qgz_bits: 8, ..ZeroConfig::zeropp(4) }));
    cases.push((8, 4, ZeroConfig { prefetch: false, ..ZeroConfig::zeropp(4) }));
    for (i, (w, l, z)) in cases.into_iter().enumerate() {
        for accum in [1, 2] {
            let model = if i % 2 == 0 { tiny.clone() } else { mlp.clone() };
            let r = train(&run(w, l, z, accum, model)).unwrap();
            let s = &r.summary;
            for rec in &r.steps {
                // Every step, not only the mean, matches.
                assert_eq!(
                    rec.intra_node_bytes, s.model_bytes_per_step.intra,
                    "case {i} {z:?} W={w} L={l} A={accum}"
                );
                assert_eq!(
                    rec.inter_node_bytes, s.model_bytes_per_step.inter,
                    "case {i} {z:?} W={w} L={l} A={accum}"
                );
                for (op, b) in &rec.bytes_by_op {
                    assert_eq!(
                        Some(b),
                        s.model_bytes_by_op.get(op),
                        "case {i} op {op} {z:?} W={w} L={l} A={accum}"
                    );
                }
            }
            assert_eq!(s.bytes_by_op, s.model_bytes_by_op, "case {i}");
        }
    }
}

#[test]
fn zeropp_cross_node_bytes_at_most_a_quarter_of_zero3() {
    let model = ModelChoice::Gpt(GptConfig::default_small());
    let a = train(&run(8, 4, ZeroConfig::zero3(), 1, model.clone())).unwrap();
    let b = train(&run(8, 4, ZeroConfig::zeropp(4), 1, model)).unwrap();
    let ratio = b.summary.bytes_per_step.inter / a.summary.bytes_per_step.inter;
    eprintln!(
        "cross-node bytes per rank per step: zero3 {} zeropp {} ratio {ratio:.4}",
        a.summary.bytes_per_step.inter, b.summary.bytes_per_step.inter
    );
    assert!(ratio <= 0.25, "ratio {ratio}");
    // The backward gather never leaves the node with hpZ.
    assert_eq!(b.summary.bytes_by_op["bwd_gather"].inter, 0.0);
}
