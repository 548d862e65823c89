//! Sharded training of candle models: ZeRO-3 with f32 communication equals
//! single-rank candle training, ZeRO++ trains, and checkpoints resume bit for
//! bit.

use zeropp_candle::CandleModel;
use zeropp_engine::RunConfig;
use zeropp_engine::config::{AdamWConfig, CommDtype, EngineConfig, ZeroConfig};
use zeropp_engine::data::TextDataset;
use zeropp_engine::data::{DataChoice, load_data};
use zeropp_engine::launch;
use zeropp_engine::reference::{Summation, train_sequential};

use crate::tiny_llama;

const STEPS: usize = 20;

fn data() -> TextDataset {
    load_data(&DataChoice::Markov { seed: 3, chars: 20_000 }).unwrap().0
}

fn run(world: usize, local: usize, zero: ZeroConfig, steps: usize) -> RunConfig {
    RunConfig {
        world,
        local_size: local,
        steps,
        eval_batches: 0,
        keep_params: true,
        engine: EngineConfig {
            zero,
            optim: AdamWConfig { lr: 1e-2, weight_decay: 0.01, ..AdamWConfig::default() },
            global_batch: 16,
            grad_accum: 2,
            // Low enough that clipping acts on most steps, so the global gradient
            // norm (summed over the ranks' shards) is part of what is compared.
            gradient_clipping: Some(0.05),
            seed: 7,
        },
        ..RunConfig::default()
    }
}

/// Single-rank candle training on whole parameter vectors (no sharding, no
/// communication, one AdamW): each micro-batch is evaluated as the `nodes x
/// local` rank slices that data parallelism splits it into, and their gradients
/// are summed in the order the hierarchical f32 reduce-scatter sums them (each
/// node's ranks in order, then the nodes in order; divided by the world). So
/// the comparison is not blurred by summation order, which candle's gemm and
/// AdamW amplify where gradients cancel across ranks.
fn reference(
    model: &CandleModel,
    data: &TextDataset,
    cfg: &RunConfig,
    nodes: usize,
    local: usize,
) -> (Vec<f32>, Vec<Vec<f32>>) {
    let order = Summation::Ranks { nodes, local };
    let r = train_sequential(model, data, &cfg.engine, cfg.steps, order).unwrap();
    (r.losses, r.params)
}

#[test]
fn zero3_f32_equals_single_rank_candle_training() {
    let data = data();
    let model = tiny_llama(data.vocab_size());
    let zero = ZeroConfig { comm_dtype: CommDtype::F32, ..ZeroConfig::zero3() };
    for (w, l) in [(4, 2), (8, 4)] {
        let (ref_losses, ref_params) = reference(&model, &data, &run(w, l, zero, STEPS), w / l, l);
        let r = launch(&model, &data, &run(w, l, zero, STEPS)).unwrap();
        let mut worst = 0.0f32;
        for (s, want) in r.steps.iter().zip(&ref_losses) {
            worst = worst.max((s.loss - want).abs() / want.abs());
        }
        eprintln!("losses: worst relative difference {worst:.2e}");
        let params = r.params.unwrap();
        for (l, (pl, ql)) in params.iter().zip(&ref_params).enumerate() {
            let mut w = 0.0f32;
            let mut at = 0;
            for (i, (p, q)) in pl.iter().zip(ql).enumerate() {
                let d = (p - q).abs() / q.abs().max(1e-3);
                if d > w {
                    w = d;
                    at = i;
                }
            }
            eprintln!("layer {l}: worst {w:.2e} at {at} ({} vs {})", pl[at], ql[at]);
            worst = worst.max(w);
        }
        eprintln!(
            "candle llama, ZeRO-3 f32 on {w} = {}x{l} vs one rank: worst relative difference {worst:.2e}",
            w / l
        );
        assert!(worst <= 1e-5, "{w}x{l}: worst relative difference {worst}");
    }
}

#[test]
fn zeropp_trains_the_candle_llama_and_counts_its_bytes() {
    let data = data();
    let model = tiny_llama(data.vocab_size());
    let r = launch(&model, &data, &run(8, 4, ZeroConfig::zeropp(4), 60)).unwrap();
    let mean =
        |s: &[zeropp_engine::metrics::StepRecord]| s.iter().map(|s| s.loss).sum::<f32>() / s.len() as f32;
    let (first, last) = (mean(&r.steps[..10]), mean(&r.steps[50..]));
    eprintln!("candle llama under ZeRO++: mean loss of steps 0-9 {first:.3}, of steps 50-59 {last:.3}");
    assert!(last < first - 0.15, "{first} -> {last}");
    // Cross-node bytes equal the analytic model, as for the native models.
    assert_eq!(r.summary.bytes_per_step, r.summary.model_bytes_per_step);
    let z3 = launch(&model, &data, &run(8, 4, ZeroConfig::zero3(), 2)).unwrap();
    let ratio = r.summary.bytes_per_step.inter / z3.summary.bytes_per_step.inter;
    assert!(ratio < 0.35, "ZeRO++ / ZeRO-3 cross-node bytes {ratio}");
}

#[test]
fn checkpoints_resume_bit_for_bit() {
    let data = data();
    let model = tiny_llama(data.vocab_size());
    let dir = tempfile::tempdir().unwrap();
    let cfg = |steps| run(4, 2, ZeroConfig::zeropp(2), steps);
    let full = launch(&model, &data, &cfg(8)).unwrap();
    let first =
        launch(&model, &data, &RunConfig { save: Some(dir.path().into()), save_every: 3, ..cfg(5) }).unwrap();
    let resumed = launch(&model, &data, &RunConfig { resume: Some(dir.path().into()), ..cfg(8) }).unwrap();
    let bits =
        |r: &[zeropp_engine::metrics::StepRecord]| r.iter().map(|s| s.loss.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&first.steps), bits(&full.steps[..5]));
    assert_eq!(bits(&resumed.steps), bits(&full.steps[5..]));
    assert_eq!(resumed.params, full.params);
}

/// A pre-norm transformer block over `[b, t, d]`, its norms and attention
/// softmax given: the standard-layer form and its composite twin differ only
/// in these two.
fn transformer(vocab: usize, standard: bool) -> zeropp_candle::CandleModel {
    use candle_core::{D, Tensor};
    use candle_nn::{Module, ModuleT, VarBuilder};
    let (d, seq, heads) = (16usize, 8usize, 2usize);
    let hd = d / heads;
    // candle-nn's LayerNorm (with a bias) as a module, or written out.
    let norm = move |vb: VarBuilder<'_>, x: &Tensor| -> candle_core::Result<Tensor> {
        if standard {
            return zeropp_candle::nn::layer_norm(d, 1e-5, vb)?.forward(x);
        }
        // candle-nn's names and init hints.
        let w = vb.get_with_hints(d, "weight", candle_nn::Init::Const(1.0))?;
        let b = vb.get_with_hints(d, "bias", candle_nn::Init::Const(0.0))?;
        let xc = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
        let r = (xc.sqr()?.mean_keepdim(D::Minus1)? + 1e-5)?.sqrt()?.recip()?;
        xc.broadcast_mul(&r)?.broadcast_mul(&w)?.broadcast_add(&b)
    };
    let softmax = move |s: &Tensor| {
        if standard { zeropp_candle::ops::softmax_last_dim(s) } else { candle_nn::ops::softmax(s, D::Minus1) }
    };
    let mut b =
        zeropp_candle::CandleModel::builder(if standard { "standard" } else { "composite" }, vocab, seq)
            .stage("embed", move |vb, ids| candle_nn::embedding(vocab, d, vb)?.forward(ids));
    for i in 0..2 {
        b = b.stage(format!("block{i}"), move |vb, x| {
            let (bs, t, _) = x.dims3()?;
            let h = norm(vb.pp("ln1"), x)?;
            let qkv = candle_nn::linear(d, 3 * d, vb.pp("qkv"))?.forward(&h)?;
            let split = |k: usize| {
                qkv.narrow(2, k * d, d)?.reshape((bs, t, heads, hd))?.transpose(1, 2)?.contiguous()
            };
            let (q, k, v) = (split(0)?, split(1)?, split(2)?);
            let mask: Vec<f32> = (0..t)
                .flat_map(|i| (0..t).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
                .collect();
            let mask = Tensor::from_vec(mask, (t, t), x.device())?;
            let scores = (q.matmul(&k.t()?)? / (hd as f64).sqrt())?.broadcast_add(&mask)?;
            let y = softmax(&scores)?.matmul(&v)?.transpose(1, 2)?.reshape((bs, t, d))?;
            let y = candle_nn::Dropout::new(0.1).forward_t(&y, false)?;
            let x = (x + candle_nn::linear(d, d, vb.pp("proj"))?.forward(&y)?)?;
            let h = norm(vb.pp("ln2"), &x)?;
            let h = candle_nn::linear(d, 4 * d, vb.pp("up"))?.forward(&h)?.gelu()?;
            x + candle_nn::linear(4 * d, d, vb.pp("down"))?.forward(&h)?
        });
    }
    b.stage("head", move |vb, x| candle_nn::linear(d, vocab, vb.pp("out"))?.forward(&norm(vb.pp("ln"), x)?))
        .build()
        .unwrap()
}

/// A transformer written with candle-nn's standard layers (`embedding`,
/// `layer_norm` with a bias, `linear`, `softmax_last_dim`, dropout in eval
/// mode), through zeropp's drop-ins, trains under ZeRO-3 f32 on 2 x 2 to the
/// loss curve of its composite twin, within 1e-4 over 30 steps.
#[test]
fn standard_candle_nn_layers_train_like_their_composite_twin() {
    let data = data();
    let cfg = run(4, 2, ZeroConfig { comm_dtype: CommDtype::F32, ..ZeroConfig::zero3() }, 30);
    let cfg = RunConfig { engine: EngineConfig { gradient_clipping: Some(1.0), ..cfg.engine }, ..cfg };
    let a = launch(&transformer(data.vocab_size(), true), &data, &cfg).unwrap();
    let b = launch(&transformer(data.vocab_size(), false), &data, &cfg).unwrap();
    let worst =
        a.steps.iter().zip(&b.steps).map(|(x, y)| (x.loss - y.loss).abs() / y.loss).fold(0.0f32, f32::max);
    eprintln!(
        "standard layers vs composite twin, 30 steps: losses {:.4} -> {:.4}, worst relative difference {worst:.2e}",
        b.steps[0].loss, b.steps[29].loss
    );
    assert!(b.steps[29].loss < b.steps[0].loss - 0.2, "the twin did not train");
    assert!(worst <= 1e-4, "worst relative loss difference {worst}");
}

/// A residual MLP with dropout 0.2 between an embedding and a head.
fn dropout_model(vocab: usize) -> CandleModel {
    use candle_nn::Module;
    let d = 16;
    CandleModel::builder("dropout", vocab, 16)
        .stage("embed", move |vb, ids| candle_nn::embedding(vocab, d, vb)?.forward(ids))
        .stage_with("mlp", move |vb, x, ctx| {
            let h = candle_nn::linear(d, 32, vb.pp("fc"))?.forward(x)?.relu()?;
            candle_nn::linear(32, d, vb.pp("proj"))?.forward(&ctx.dropout(&h, 0.2)?)? + x
        })
        .stage("head", move |vb, x| candle_nn::linear(d, vocab, vb)?.forward(x))
        .build()
        .unwrap()
}

/// Dropout masks are keyed on the step and the micro-batch: the same batch
/// draws the same masks at the same place, new ones in another step or
/// micro-batch, and none in evaluation.
#[test]
fn dropout_masks_follow_the_step_and_micro_batch() {
    use zeropp_engine::model::{Model, full_forward_backward_at, init_params};
    let data = data();
    let model = dropout_model(data.vocab_size());
    let params = init_params(&model, 3).unwrap();
    let b = data.global_batch(0, 0, 4, 16, 7).unwrap();
    let loss = |step, micro| full_forward_backward_at(&model, &params, &b, step, micro).unwrap().0;
    assert_eq!(loss(1, 0).to_bits(), loss(1, 0).to_bits(), "same step, same masks");
    for (s, m) in [(2, 0), (1, 1), (0, 0)] {
        assert_ne!(loss(1, 0), loss(s, m), "step {s} micro {m} repeated step 1's masks");
    }
    let eval = |_| {
        let mut tape = model.start_eval(&b).unwrap();
        for (i, p) in params.iter().enumerate() {
            model.forward(i, p, &mut tape).unwrap();
        }
        model.loss(&tape)
    };
    assert_eq!(eval(0).to_bits(), eval(1).to_bits());
    assert_ne!(eval(0), loss(1, 0), "evaluation drops nothing");
}

/// With dropout, ZeRO-3 at f32 on 2 x 2 equals the sequential reference
/// step for step (both key the masks on the step and micro-batch), and a
/// resumed run draws the masks the uninterrupted run drew.
#[test]
fn zero3_with_dropout_equals_the_reference_and_resumes() {
    let data = data();
    let model = dropout_model(data.vocab_size());
    let zero = ZeroConfig { comm_dtype: CommDtype::F32, ..ZeroConfig::zero3() };
    let (ref_losses, _) = reference(&model, &data, &run(4, 2, zero, 10), 2, 2);
    let full = launch(&model, &data, &run(4, 2, zero, 10)).unwrap();
    for (i, (s, want)) in full.steps.iter().zip(&ref_losses).enumerate() {
        let e = (s.loss - want).abs() / want.abs();
        assert!(e <= 1e-5, "step {i}: loss {} vs the reference's {want}", s.loss);
    }
    let dir = tempfile::tempdir().unwrap();
    let save = RunConfig { save: Some(dir.path().into()), save_every: 4, ..run(4, 2, zero, 4) };
    launch(&model, &data, &save).unwrap();
    let resumed =
        launch(&model, &data, &RunConfig { resume: Some(dir.path().into()), ..run(4, 2, zero, 10) }).unwrap();
    let bits =
        |r: &[zeropp_engine::metrics::StepRecord]| r.iter().map(|s| s.loss.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&resumed.steps), bits(&full.steps[4..]), "the resumed steps' masks");
}
