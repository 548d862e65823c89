//! `zeropp_candle::ops` and `nn`: candle-nn's fused ops with a backward pass.
//! Each gradient is checked against the op's composite form (candle-nn's
//! `*_slow` functions, differentiated by candle's autograd in float64) and by
//! central differences of the op itself; the forward must be candle-nn's.

use candle_core::{D, DType, Device, Module, Tensor, Var};
use zeropp_candle::ops;

type Op = fn(&[Tensor]) -> candle_core::Result<Tensor>;

/// Deterministic values in about [-scale, scale].
fn values(n: usize, seed: u64, scale: f64) -> Vec<f64> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * scale
        })
        .collect()
}

fn tensor(shape: &[usize], seed: u64, scale: f64, offset: f64) -> Tensor {
    let v: Vec<f64> = values(shape.iter().product(), seed, scale).into_iter().map(|x| x + offset).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// The gradients of `sum(op(args) * w)` for the args marked `wants`, in f64.
fn grads(
    op: Op,
    args: &[Tensor],
    w: &Tensor,
    wants: &[bool],
    dtype: DType,
) -> (Tensor, Vec<Option<Vec<f64>>>) {
    let vars: Vec<Var> =
        args.iter().map(|a| Var::from_tensor(&a.to_dtype(dtype).unwrap()).unwrap()).collect();
    let ins: Vec<Tensor> = vars
        .iter()
        .zip(wants)
        .map(|(v, &want)| if want { v.as_tensor().clone() } else { v.as_tensor().detach() })
        .collect();
    let y = op(&ins).unwrap();
    let objective = (y.to_dtype(DType::F64).unwrap() * w).unwrap().sum_all().unwrap();
    let g = objective.backward().unwrap();
    let out = vars
        .iter()
        .zip(wants)
        .map(|(v, &want)| {
            want.then(|| {
                let t = g.get(v.as_tensor()).expect("a gradient for every wanted input");
                t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap()
            })
        })
        .collect();
    (y.to_dtype(DType::F64).unwrap(), out)
}

fn worst(a: &[f64], b: &[f64]) -> f64 {
    let scale = b.iter().fold(1e-3f64, |m, x| m.max(x.abs()));
    a.iter().zip(b).map(|(x, y)| (x - y).abs() / scale).fold(0.0, f64::max)
}

/// One op: its fused form (ours), its composite form, the inputs and which
/// get a gradient.
struct Case {
    name: &'static str,
    fused: Op,
    composite: Op,
    args: Vec<Tensor>,
    wants: Vec<bool>,
}

fn rope_tables(t: usize, half: usize, seed: u64) -> (Tensor, Tensor) {
    let a = tensor(&[t, half], seed, 3.0, 0.0);
    (a.cos().unwrap(), a.sin().unwrap())
}

fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    for (k, shape) in [[2usize, 3, 7], [1, 5, 33], [3, 2, 64]].into_iter().enumerate() {
        let d = shape[2];
        let seed = 10 * k as u64;
        let x = tensor(&shape, seed + 1, 2.0, 0.3);
        let alpha = tensor(&[d], seed + 2, 0.5, 1.0);
        let beta = tensor(&[d], seed + 3, 0.5, 0.0);
        out.push(Case {
            name: "softmax_last_dim",
            fused: |a| ops::softmax_last_dim(&a[0]),
            composite: |a| candle_nn::ops::softmax(&a[0], D::Minus1),
            args: vec![x.clone()],
            wants: vec![true],
        });
        out.push(Case {
            name: "rms_norm",
            fused: |a| ops::rms_norm(&a[0], &a[1], 1e-5),
            composite: |a| candle_nn::ops::rms_norm_slow(&a[0], &a[1], 1e-5),
            args: vec![x.clone(), alpha.clone()],
            wants: vec![true, true],
        });
        out.push(Case {
            name: "layer_norm",
            fused: |a| ops::layer_norm(&a[0], &a[1], &a[2], 1e-5),
            composite: |a| candle_nn::ops::layer_norm_slow(&a[0], &a[1], &a[2], 1e-5),
            args: vec![x, alpha, beta],
            wants: vec![true, true, true],
        });
    }
    for (k, shape) in [[2usize, 3, 7], [1, 4, 33]].into_iter().enumerate() {
        out.push(Case {
            name: "silu_mul",
            fused: |a| ops::silu_mul(&a[0], &a[1]),
            composite: |a| a[0].silu()? * &a[1],
            args: vec![tensor(&shape, 300 + k as u64, 4.0, 0.0), tensor(&shape, 310 + k as u64, 2.0, 0.0)],
            wants: vec![true, true],
        });
    }
    for (k, shape) in [[2usize, 3, 5, 5], [1, 2, 3, 7], [1, 1, 1, 4]].into_iter().enumerate() {
        out.push(Case {
            name: "softmax_causal",
            fused: |a| ops::softmax_causal(&a[0], 0.35),
            composite: |a| {
                let (tq, tk) = (a[0].dim(2)?, a[0].dim(3)?);
                let mask: Vec<f64> = (0..tq)
                    .flat_map(|i| (0..tk).map(move |j| if j > i + tk - tq { f64::NEG_INFINITY } else { 0.0 }))
                    .collect();
                let mask = Tensor::from_vec(mask, (tq, tk), a[0].device())?.to_dtype(a[0].dtype())?;
                candle_nn::ops::softmax(&(&a[0] * 0.35)?.broadcast_add(&mask)?, D::Minus1)
            },
            args: vec![tensor(&shape, 200 + k as u64, 3.0, 0.0)],
            wants: vec![true],
        });
    }
    // Multi-head, grouped-query (2 query heads per key/value head), and a
    // query window shorter than the keys (t_q 3 of t_k 5).
    for (k, (b, tq, tk, h, kv, d)) in
        [(2usize, 5usize, 5usize, 2usize, 2usize, 4usize), (1, 6, 6, 4, 2, 8), (2, 3, 5, 3, 1, 2)]
            .into_iter()
            .enumerate()
    {
        let seed = 400 + 10 * k as u64;
        out.push(Case {
            name: "causal_attention",
            fused: |a| ops::causal_attention(&a[0], &a[1], &a[2], 0.4),
            composite: |a| ops::causal_attention_composite(&a[0], &a[1], &a[2], 0.4),
            args: vec![
                tensor(&[b, tq, h, d], seed + 1, 2.0, 0.0),
                tensor(&[b, tk, kv, d], seed + 2, 2.0, 0.0),
                tensor(&[b, tk, kv, d], seed + 3, 1.0, 0.0),
            ],
            wants: vec![true, true, true],
        });
    }
    for (k, (b, h, t, hd)) in [(1usize, 2usize, 3usize, 4usize), (2, 3, 5, 8)].into_iter().enumerate() {
        let seed = 100 + 10 * k as u64;
        let (cos, sin) = rope_tables(t, hd / 2, seed);
        let bhtd = tensor(&[b, h, t, hd], seed + 1, 1.0, 0.0);
        let bthd = tensor(&[b, t, h, hd], seed + 2, 1.0, 0.0);
        out.push(Case {
            name: "rope",
            fused: |a| ops::rope(&a[0], &a[1], &a[2]),
            composite: |a| candle_nn::rotary_emb::rope_slow(&a[0], &a[1], &a[2]),
            args: vec![bhtd.clone(), cos.clone(), sin.clone()],
            wants: vec![true, false, false],
        });
        out.push(Case {
            name: "rope_i",
            fused: |a| ops::rope_i(&a[0], &a[1], &a[2]),
            composite: |a| candle_nn::rotary_emb::rope_i_slow(&a[0], &a[1], &a[2]),
            args: vec![bhtd, cos.clone(), sin.clone()],
            wants: vec![true, false, false],
        });
        out.push(Case {
            name: "rope_thd",
            fused: |a| ops::rope_thd(&a[0], &a[1], &a[2]),
            // rope_thd is rope on the [b, h, t, d] transpose.
            composite: |a| {
                candle_nn::rotary_emb::rope_slow(&a[0].transpose(1, 2)?.contiguous()?, &a[1], &a[2])?
                    .transpose(1, 2)
            },
            args: vec![bthd, cos, sin],
            wants: vec![true, false, false],
        });
    }
    out
}

/// f32 gradients of every op equal its composite form's float64 gradients.
#[test]
fn gradients_equal_the_composite_form_in_float64() {
    for (i, c) in cases().iter().enumerate() {
        let y_shape = c.args[0].dims().to_vec();
        let w = tensor(&y_shape, 1000 + i as u64, 1.0, 0.0);
        let (y, ours) = grads(c.fused, &c.args, &w, &c.wants, DType::F32);
        let (y_ref, reference) = grads(c.composite, &c.args, &w, &c.wants, DType::F64);
        let fwd = worst(
            &y.flatten_all().unwrap().to_vec1().unwrap(),
            &y_ref.flatten_all().unwrap().to_vec1().unwrap(),
        );
        assert!(fwd < 1e-5, "{}: forward differs from the composite form by {fwd}", c.name);
        for (j, (a, b)) in ours.iter().zip(&reference).enumerate() {
            if let (Some(a), Some(b)) = (a, b) {
                let e = worst(a, b);
                assert!(
                    e < 2e-5,
                    "{} {:?}: input {j}'s gradient differs by {e} (relative to its largest)",
                    c.name,
                    y_shape
                );
            }
        }
    }
}

/// Central differences of `sum(op(x) * w)` in f32 at each input's largest
/// gradients.
#[test]
fn gradients_match_central_differences() {
    for (i, c) in cases().iter().enumerate() {
        let w = tensor(c.args[0].dims(), 2000 + i as u64, 1.0, 0.0);
        let (_, g) = grads(c.fused, &c.args, &w, &c.wants, DType::F32);
        let objective = |args: &[Tensor]| -> f64 {
            let a32: Vec<Tensor> = args.iter().map(|a| a.to_dtype(DType::F32).unwrap()).collect();
            let y = (c.fused)(&a32).unwrap().to_dtype(DType::F64).unwrap();
            (y * &w).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap()
        };
        for (j, gj) in g.iter().enumerate() {
            let Some(gj) = gj else { continue };
            let mut idx: Vec<usize> = (0..gj.len()).collect();
            idx.sort_by(|&a, &b| gj[b].abs().total_cmp(&gj[a].abs()));
            for &e in idx.iter().take(4) {
                let h = 1e-2;
                let shifted = |delta: f64| {
                    let mut args = c.args.clone();
                    let mut v = args[j].flatten_all().unwrap().to_vec1::<f64>().unwrap();
                    v[e] += delta;
                    args[j] = Tensor::from_vec(v, c.args[j].dims(), &Device::Cpu).unwrap();
                    objective(&args)
                };
                let fd = (shifted(h) - shifted(-h)) / (2.0 * h);
                let tol = 2e-3 * gj[idx[0]].abs().max(1.0);
                assert!(
                    (fd - gj[e]).abs() < tol,
                    "{} input {j} element {e}: backward {} vs differences {fd}",
                    c.name,
                    gj[e]
                );
            }
        }
    }
}

/// In bf16 the ops run and their gradients stay within bf16's precision of the f32 ones.
#[test]
fn bf16_gradients_follow_the_f32_ones() {
    for (i, c) in cases().iter().enumerate() {
        let w = tensor(c.args[0].dims(), 3000 + i as u64, 1.0, 0.0);
        let (_, g32) = grads(c.fused, &c.args, &w, &c.wants, DType::F32);
        let (_, g16) = grads(c.fused, &c.args, &w, &c.wants, DType::BF16);
        for (j, (a, b)) in g16.iter().zip(&g32).enumerate() {
            if let (Some(a), Some(b)) = (a, b) {
                let e = worst(a, b);
                assert!(e < 0.05, "{} input {j}: bf16 gradient off by {e}", c.name);
            }
        }
    }
}

/// A transposed (non-contiguous) input works, where candle-nn's kernels refuse it.
#[test]
fn non_contiguous_inputs_are_accepted() {
    let x = tensor(&[3, 5], 7, 1.0, 0.0).to_dtype(DType::F32).unwrap();
    let xt = x.t().unwrap();
    assert!(candle_nn::ops::softmax_last_dim(&xt).is_err() || xt.is_contiguous());
    let ours = ops::softmax_last_dim(&xt).unwrap().to_vec2::<f32>().unwrap();
    let reference = candle_nn::ops::softmax(&xt, D::Minus1).unwrap().to_vec2::<f32>().unwrap();
    for (a, b) in ours.iter().flatten().zip(reference.iter().flatten()) {
        assert!((a - b).abs() < 1e-6);
    }
}

/// `nn::layer_norm` and `nn::rms_norm` ask for candle-nn's names and give
/// candle-nn's values, with a gradient for every parameter (candle-nn's
/// `LayerNorm` with a bias gives none).
#[test]
fn nn_modules_are_drop_in_and_differentiable() {
    use candle_nn::{VarBuilder, VarMap};
    let x = tensor(&[2, 3, 6], 9, 1.5, 0.2).to_dtype(DType::F32).unwrap();
    for rms in [false, true] {
        let map = VarMap::new();
        let vb = VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
        let (ours, theirs): (Box<dyn Module>, Box<dyn Module>) = if rms {
            (
                Box::new(zeropp_candle::nn::rms_norm(6, 1e-5, vb.pp("n")).unwrap()),
                Box::new(candle_nn::rms_norm(6, 1e-5, vb.pp("n")).unwrap()),
            )
        } else {
            (
                Box::new(zeropp_candle::nn::layer_norm(6, 1e-5, vb.pp("n")).unwrap()),
                Box::new(candle_nn::layer_norm(6, 1e-5, vb.pp("n")).unwrap()),
            )
        };
        let names: Vec<String> = map.data().lock().unwrap().keys().cloned().collect();
        assert_eq!(names.len(), if rms { 1 } else { 2 }, "{names:?}");
        let (a, b) = (ours.forward(&x).unwrap(), theirs.forward(&x).unwrap());
        let diff = (a.clone() - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff < 1e-6, "rms {rms}: forward differs by {diff}");
        let g = a.sqr().unwrap().sum_all().unwrap().backward().unwrap();
        for v in map.all_vars() {
            assert!(g.get(v.as_tensor()).is_some(), "rms {rms}: a parameter without a gradient");
        }
    }
}

/// The attention's backward uses the probabilities its forward kept; a
/// second backward of the same graph (nothing kept any more) recomputes
/// them and must give the same gradients.
#[test]
fn causal_attention_backward_recomputes_what_was_not_kept() {
    let t = |shape: &[usize], seed| {
        Var::from_tensor(&tensor(shape, seed, 1.5, 0.0).to_dtype(DType::F32).unwrap()).unwrap()
    };
    let (q, k, v) = (t(&[2, 5, 4, 8], 501), t(&[2, 7, 2, 8], 502), t(&[2, 7, 2, 8], 503));
    let w = tensor(&[2, 5, 4, 8], 504, 1.0, 0.0).to_dtype(DType::F32).unwrap();
    let y = ops::causal_attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), 0.3).unwrap();
    let loss = (y * &w).unwrap().sum_all().unwrap();
    let (first, second) = (loss.backward().unwrap(), loss.backward().unwrap());
    for x in [&q, &k, &v] {
        let a = first.get(x.as_tensor()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let b = second.get(x.as_tensor()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let e = worst(
            &a.iter().map(|&v| v as f64).collect::<Vec<_>>(),
            &b.iter().map(|&v| v as f64).collect::<Vec<_>>(),
        );
        assert!(e < 1e-5, "kept and recomputed probabilities give gradients {e} apart");
    }
}
