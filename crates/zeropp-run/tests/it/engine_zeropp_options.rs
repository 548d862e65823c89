//! The ZeRO++ options added with the DeepSpeed audit: the INT8 hpZ wire, the
//! 1-D exclusion under qgZ, and the routing of the world collectives.

use zeropp_engine::RunConfig;
use zeropp_engine::TrainReport;
use zeropp_engine::config::{CommDtype, EngineConfig, HpzWire, QgzConfig, Routing, ZeroConfig};
use zeropp_engine::model::GptConfig;
use zeropp_run::train::{TrainConfig, train};

fn cfg(world: usize, local: usize, zero: ZeroConfig) -> TrainConfig {
    let engine = EngineConfig { zero, global_batch: 2 * world, grad_accum: 2, ..EngineConfig::default() };
    {
        let b = crate::tiny_gpt_run(world, local, engine);
        TrainConfig { run: RunConfig { steps: 6, eval_batches: 1, ..b.run }, ..b }
    }
}

fn loss_bits(r: &TrainReport) -> Vec<u32> {
    r.steps.iter().map(|s| s.loss.to_bits()).collect()
}

fn param_bits(r: &TrainReport) -> Vec<u32> {
    r.params.as_ref().unwrap().iter().flatten().map(|x| x.to_bits()).collect()
}

/// With `--hpz-wire int8` the secondary shard holds the very qwZ encodings the
/// forward gather received, so the backward sees exactly the weights a fresh qwZ
/// world gather would give: ZeRO++ with the INT8 hpZ wire is bit-identical to
/// qwZ + qgZ without hpZ (whose backward re-gathers over the world), and sends
/// fewer bytes in the backward gather than the dense hpZ wire.
#[test]
fn int8_hpz_wire_gives_the_forward_weights_back() {
    for (w, l) in [(8, 4), (4, 2)] {
        let no_hpz = ZeroConfig { hpz_size: 1, ..ZeroConfig::zeropp(l) };
        let int8 = ZeroConfig { hpz_wire: HpzWire::Int8, ..ZeroConfig::zeropp(l) };
        let a = train(&cfg(w, l, no_hpz)).unwrap();
        let b = train(&cfg(w, l, int8)).unwrap();
        assert_eq!(loss_bits(&a), loss_bits(&b), "{w}x{l}");
        assert_eq!(param_bits(&a), param_bits(&b), "{w}x{l}");
        let dense = train(&cfg(w, l, ZeroConfig::zeropp(l))).unwrap();
        // The dense wire holds the same (bf16-rounded, dequantized) weights, so the
        // INT8 wire changes bytes and memory, never the training run.
        assert_eq!(loss_bits(&dense), loss_bits(&b), "{w}x{l}");
        let bwd = |r: &TrainReport| r.summary.bytes_by_op["bwd_gather"].intra;
        assert!(bwd(&b) < 0.6 * bwd(&dense), "int8 {} vs dense {}", bwd(&b), bwd(&dense));
        assert_eq!(b.summary.bytes_by_op["bwd_gather"].inter, 0.0);
    }
}

/// Excluding the 1-D parameters from qgZ reduces them at the baseline precision
/// (f32 here) instead of INT4: after one step from the same start, the 1-D
/// parameters of a qgZ run with the exclusion equal those of the exact ZeRO-3 f32
/// run (up to summation order), while plain qgZ moves some of them differently
/// (INT4 rounds small gradients to zero).
#[test]
fn one_d_parameters_bypass_int4() {
    let exact = ZeroConfig { comm_dtype: CommDtype::F32, ..ZeroConfig::zero3() };
    let qgz = ZeroConfig { comm_dtype: CommDtype::F32, ..ZeroConfig::zero3() }.with_qgz(QgzConfig::default());
    let excl = qgz.with_qgz(QgzConfig { exclude_1d: true, ..QgzConfig::default() });
    let one_step = |z: ZeroConfig| {
        let mut c = cfg(8, 4, z);
        c.run.steps = 1;
        train(&c).unwrap().params.unwrap()
    };
    let (p0, p1, p2) = (one_step(exact), one_step(qgz), one_step(excl));
    // The GPT's layers: embed (2-D only), blocks (LayerNorms and biases are 1-D), head.
    let vocab = zeropp_engine::data::load_data(&cfg(8, 4, exact).data).unwrap().1.vocab;
    let model = zeropp_engine::model::Gpt::new(GptConfig::tiny().with_vocab(vocab)).unwrap();
    use zeropp_engine::model::Model;
    let (mut err_qgz, mut err_excl, mut n1d) = (0.0f64, 0.0f64, 0usize);
    for (l, layer) in model.layers().iter().enumerate() {
        let mut at = 0;
        for p in &layer.params {
            let n: usize = p.shape.iter().product();
            // The attention bias of the keys has an exact gradient of 0 (softmax is
            // shift-invariant), so its sign after one Adam step is rounding noise.
            if p.shape.len() == 1 && !p.name.contains("qkv.bias") {
                for i in at..at + n {
                    err_qgz += f64::from(p1[l][i] - p0[l][i]).powi(2);
                    err_excl += f64::from(p2[l][i] - p0[l][i]).powi(2);

                    n1d += 1;
                }
            }
            at += n;
        }
    }
    eprintln!(
        "1-D params ({n1d}): squared deviation from exact, qgZ {err_qgz:.3e}, qgZ + exclusion {err_excl:.3e}"
    );
    assert!(n1d > 0);
    assert!(err_qgz > 0.0, "INT4 left the 1-D parameters untouched?");
    // The exclusion reduces them in f32 (only the summation order differs).
    assert!(err_excl <= 1e-6 * err_qgz, "{err_excl} vs {err_qgz}");
}

/// Flat and hierarchical routing compute the same training run: gathers are bit
/// identical, and the dense reductions differ only in summation order, so the
/// losses agree closely (bitwise for plain ZeRO++, whose only reduction is
/// qgZ's either way).
#[test]
fn routing_changes_bytes_not_results() {
    let flat = |z: ZeroConfig| ZeroConfig { routing: Routing::Flat, ..z };
    let plain = ZeroConfig::zeropp_plain(4);
    let a = train(&cfg(8, 4, plain)).unwrap();
    let b = train(&cfg(8, 4, flat(plain))).unwrap();
    assert_eq!(loss_bits(&a), loss_bits(&b));
    assert!(b.summary.bytes_per_step.inter > a.summary.bytes_per_step.inter);
    // The default ZeRO++ also reduces the 1-D parameters densely, in another order.
    let e = train(&cfg(8, 4, ZeroConfig::zeropp(4))).unwrap();
    let f = train(&cfg(8, 4, flat(ZeroConfig::zeropp(4)))).unwrap();
    for (x, y) in e.steps.iter().zip(&f.steps) {
        assert!((x.loss - y.loss).abs() <= 1e-3 * x.loss.abs(), "{} vs {}", x.loss, y.loss);
    }
    assert!(f.summary.bytes_per_step.inter > e.summary.bytes_per_step.inter);
    let z3 = ZeroConfig::zero3();
    let c = train(&cfg(8, 4, z3)).unwrap();
    let d = train(&cfg(8, 4, flat(z3))).unwrap();
    for (x, y) in c.steps.iter().zip(&d.steps) {
        assert!((x.loss - y.loss).abs() <= 1e-3 * x.loss.abs(), "{} vs {}", x.loss, y.loss);
    }
    assert!((d.summary.bytes_per_step.inter / c.summary.bytes_per_step.inter - 4.0).abs() < 0.05);
}
