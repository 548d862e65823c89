//! The CUDA kernels' source, run on the CPU by `cuda/emulate.cpp` (one thread
//! block of std::threads, the CUDA built-ins shimmed), against the Rust CPU
//! scalar kernel bit for bit. This checks the kernels' formulas, reductions,
//! stochastic-rounding stream and INT4 packing where no GPU is available (CI);
//! `gpu.rs` checks the real device.
//!
//! `cargo xtask gpu test` builds the emulator with g++ and passes its path in
//! `ZEROPP_CUDA_EMULATOR`; without it the test skips with one counted line
//! (a failure under `CI=true`).

use std::io::Write as _;
use std::process::{Command, Stdio};

use proptest::prelude::*;
use zeropp_quant::half::{bf16, f16};
use zeropp_quant::{
    Bits, NonFinite, QuantError, QuantSpec, Quantized, Rounding, Scheme, dequant_reduce_quant, dequantize,
    dequantize_add, encoded_len, quantize, quantize_to_wire, wire,
};

use crate::common::{config, vector};
use crate::gpu_cases::{cpu, reduce_inputs, rounding_strategy, spec_strategy};

const ENV: &str = "ZEROPP_CUDA_EMULATOR";

/// A request for the emulator (see emulate.cpp's protocol).
struct Req(Vec<u8>);

impl Req {
    fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(mut self, b: &[u8]) -> Self {
        self.0.extend_from_slice(b);
        self
    }
    fn spec(self, s: QuantSpec) -> Self {
        self.u32(s.group_size() as u32).u32(s.bits().bits()).u32(u32::from(s.scheme() == Scheme::Asymmetric))
    }
    fn out(self, s: QuantSpec, r: Rounding) -> Self {
        self.out_nf(s, r, NonFinite::Error)
    }
    /// The output's spec, rounding and non-finite policy.
    fn out_nf(self, s: QuantSpec, r: Rounding, nf: NonFinite) -> Self {
        let (st, seed) = match r {
            Rounding::Stochastic { seed } => (1, seed),
            _ => (0, 0),
        };
        self.spec(s).u32(st).u64(seed).u32(u32::from(nf == NonFinite::Propagate))
    }
    fn run(self, exe: &str) -> Vec<u8> {
        let mut child = Command::new(exe).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
        child.stdin.take().unwrap().write_all(&self.0).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "emulator failed: {}", out.status);
        out.stdout
    }
}

/// A quantize reply as the kernel's result: the wire bytes (the CPU's header
/// in front of the emulated payload), or the first non-finite index (which
/// the host reads only under [`NonFinite::Error`], as `cuda/kernels.rs` does).
fn reply(spec: QuantSpec, len: usize, out: &[u8], nf: NonFinite) -> Result<Vec<u8>, usize> {
    let bad = u64::from_le_bytes(out[..8].try_into().unwrap());
    if bad != u64::MAX && nf == NonFinite::Error {
        return Err(bad as usize);
    }
    let mut w = Quantized::zeroed(spec, len).unwrap().to_bytes();
    w[wire::HEADER_LEN..].copy_from_slice(&out[8..]);
    Ok(w)
}

fn payload(q: &Quantized) -> Vec<u8> {
    q.to_bytes()[wire::HEADER_LEN..].to_vec()
}

/// Quantizes `x` (as dtype 0 f32, 1 bf16, 2 f16) in the emulator and on the
/// CPU, under the non-finite policy `nf`.
fn same_quantize(exe: &str, x: &[f32], dtype: u32, spec: QuantSpec, r: Rounding, nf: NonFinite) {
    let o = cpu(r).with_non_finite(nf);
    let mut want = vec![0u8; encoded_len(spec, x.len())];
    let (cpu_res, raw): (_, Vec<u8>) = match dtype {
        0 => (quantize_to_wire(x, spec, &o, &mut want), x.iter().flat_map(|v| v.to_le_bytes()).collect()),
        1 => {
            let h: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            (
                quantize_to_wire(&h, spec, &o, &mut want),
                h.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect(),
            )
        }
        _ => {
            let h: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
            (
                quantize_to_wire(&h, spec, &o, &mut want),
                h.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect(),
            )
        }
    };
    let out = Req(Vec::new()).u32(1).u32(dtype).u64(x.len() as u64).out_nf(spec, r, nf).bytes(&raw).run(exe);
    match (cpu_res, reply(spec, x.len(), &out, nf)) {
        (Ok(_), Ok(got)) => {
            let at = got.iter().zip(&want).position(|(a, b)| a != b);
            assert!(
                at.is_none(),
                "emulated kernel != CPU for {spec:?} {r:?} {nf:?} dtype {dtype} len {}: byte {at:?}",
                x.len()
            );
        }
        (Err(QuantError::NonFinite { index, .. }), Err(bad)) => assert_eq!(index, bad),
        (c, g) => panic!("CPU {c:?} vs emulated kernel {:?}", g.map(|w| w.len())),
    }
}

#[test]
fn suite() {
    let Some(exe) = std::env::var(ENV).ok().filter(|p| std::path::Path::new(p).is_file()) else {
        // CI runs these through `cargo xtask`, which builds the emulator: never skip there.
        let ci = std::env::var("CI").is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"));
        assert!(
            !ci,
            "CI=true but {ENV} names no emulator binary (run the tests with `cargo xtask gpu test`)"
        );
        let _ = writeln!(
            std::io::stderr(),
            "gpu_emu: 7 tests skipped: no kernel emulator ({ENV} unset; `cargo xtask gpu test` builds it)"
        );
        return;
    };
    quantize_matches_cpu(&exe);
    edge_cases(&exe);
    dequant_matches_cpu(&exe);
    reduce_matches_cpu(&exe);
    elementwise_matches_cpu(&exe);
    hadamard_matches_cpu(&exe);
    propagate_matches_cpu(&exe);
}

/// `NonFinite::Propagate` in the kernels against the CPU's, bit for bit: NaN
/// and ±Inf planted at any positions, in every dtype, spec and rounding, give
/// the same poisoned groups (canonical-NaN scale and offset, integers 0) and
/// the same bytes in every other group; the fused reduce of inputs that hold
/// poisoned groups poisons the same output groups; a poisoned group decodes
/// to NaN on both.
fn propagate_matches_cpu(exe: &str) {
    let bad = prop::sample::select(vec![f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY]);
    let plant = prop::collection::vec((any::<prop::sample::Index>(), bad), 0..4);
    proptest!(config(32), |(x in vector(), plant in plant.clone(), spec in spec_strategy(), r in rounding_strategy(), dtype in 0u32..3)| {
        let mut x: Vec<f32> = if dtype == 2 { x.iter().map(|v| v / 64.0).collect() } else { x };
        if !x.is_empty() {
            for (at, v) in &plant {
                let i = at.index(x.len());
                x[i] = *v;
            }
        }
        same_quantize(exe, &x, dtype, spec, r, NonFinite::Propagate);
    });
    let inputs = (1usize..=6, prop::collection::vec(spec_strategy(), 6), 1usize..1500, any::<u64>());
    proptest!(config(24), |((k, specs, len, seed) in inputs, plant in plant, out_spec in spec_strategy(), r in rounding_strategy())| {
        let p = cpu(r).with_non_finite(NonFinite::Propagate);
        // Each input re-encoded from its values with the planted non-finite
        // ones, so that some of its groups are poisoned.
        let qs: Vec<Quantized> = reduce_inputs(k, &specs, len, seed)
            .iter()
            .enumerate()
            .map(|(j, q)| {
                let mut x = dequantize(q, &p).unwrap();
                for (at, v) in plant.iter().filter(|(at, _)| at.index(k) == j) {
                    let i = at.index(len);
                    x[i] = *v;
                }
                quantize(&x, q.spec(), &p.with_rounding(Rounding::NearestEven)).unwrap()
            })
            .collect();
        let want = dequant_reduce_quant(&qs, out_spec, &p).unwrap();
        let mut req = Req(Vec::new()).u32(2).u32(k as u32).u64(len as u64);
        for q in &qs {
            req = req.spec(q.spec()).bytes(&payload(q));
        }
        let out = req.out_nf(out_spec, r, NonFinite::Propagate).run(exe);
        prop_assert_eq!(reply(out_spec, len, &out, NonFinite::Propagate).unwrap(), want.to_bytes());
        // Decoding: NaN exactly where the CPU decodes NaN.
        let o = cpu(Rounding::NearestEven);
        let cpu_y = dequantize(&want, &o).unwrap();
        let zeros = vec![0u8; 4 * len];
        let out = Req(Vec::new()).u32(3).u64(len as u64).spec(out_spec).bytes(&payload(&want)).u32(0).bytes(&zeros).run(exe);
        let got: Vec<u32> = out.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
        prop_assert_eq!(canon(&got), canon(&cpu_y.iter().map(|v| v.to_bits()).collect::<Vec<_>>()));
    });
}

/// The Hadamard rotation kernel against the CPU's, both ways, bit for bit:
/// every power-of-two group size, lengths with a partial last group, stream
/// positions off word boundaries and past 2^32 words (another key block).
fn hadamard_matches_cpu(exe: &str) {
    use zeropp_quant::{Hadamard, Options};
    let g = prop::sample::select(vec![1usize, 2, 8, 32, 64, 256, 1024, 8192]);
    let pos = prop_oneof![0u64..100_000, (1u64 << 37) - 5000..(1u64 << 37) + 5000];
    proptest!(config(40), |(x in vector(), g in g, seed: u64, pos in pos, inverse: bool)| {
        let h = Hadamard::new(g, seed).unwrap();
        let o = Options::default().with_kernel(zeropp_quant::Kernel::Scalar);
        let mut want = x.clone();
        if inverse { h.inverse(&mut want, pos, &o).unwrap() } else { h.forward(&mut want, pos, &o).unwrap() }
        let scale = (1.0 / (g as f64).sqrt()) as f32;
        let raw: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
        let out = Req(Vec::new()).u32(5).u64(x.len() as u64).u32(g as u32).u64(pos).u64(seed)
            .bytes(&scale.to_le_bytes()).u32(u32::from(inverse)).bytes(&raw).run(exe);
        let got: Vec<u32> = out.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
        prop_assert_eq!(canon(&got), canon(&want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()));
    });
}

/// The element-wise kernels of comm's device collectives (f32 and bf16 add,
/// divide, bf16 rounding) against Rust's `+=`, `/=` and `half::bf16::from_f32`,
/// bit for bit, on values that include NaN, ±Inf, subnormals and rounding ties.
fn elementwise_matches_cpu(exe: &str) {
    let special = prop_oneof![
        4 => any::<u32>().prop_map(f32::from_bits),
        1 => prop::sample::select(vec![
            f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, f32::MIN_POSITIVE / 3.0,
            f32::from_bits(0x3F80_8000), f32::from_bits(0x3F81_8000), f32::from_bits(0x7F7F_FFFF),
        ]),
    ];
    let vals = prop::collection::vec(special, 0..300);
    proptest!(config(48), |(x in vals.clone(), a in vals, by in any::<u32>().prop_map(f32::from_bits))| {
        let n = x.len().min(a.len());
        let (x, a) = (&x[..n], &a[..n]);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<u32>>();
        let f32s = |b: &[u8]| b.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect::<Vec<u32>>();
        let req = |kind: u32| Req(Vec::new()).u32(4).u32(kind).u64(n as u64).bytes(&by.to_le_bytes());
        let acc: Vec<u8> = a.iter().flat_map(|v| v.to_le_bytes()).collect();
        let src: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
        // add_f32
        let got = f32s(&req(0).bytes(&src).bytes(&acc).run(exe));
        let want: Vec<f32> = a.iter().zip(x).map(|(p, q)| p + q).collect();
        prop_assert_eq!(canon(&got), canon(&bits(&want)));
        // add_bf16
        let h: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        let hb: Vec<u8> = h.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect();
        let got = f32s(&req(1).bytes(&hb).bytes(&acc).run(exe));
        let want: Vec<f32> = a.iter().zip(&h).map(|(p, q)| p + q.to_f32()).collect();
        prop_assert_eq!(canon(&got), canon(&bits(&want)));
        // div_f32
        let got = f32s(&req(2).bytes(&acc).run(exe));
        let want: Vec<f32> = a.iter().map(|p| p / by).collect();
        prop_assert_eq!(canon(&got), canon(&bits(&want)));
        // feedback (qgZ LoCo): r = beta·r + (1 − beta)·(c − d), beta in [0, 1).
        let beta = (by.to_bits() % 1000) as f32 / 1000.0;
        let d: Vec<f32> = x.iter().rev().copied().collect();
        let cd: Vec<u8> = x.iter().chain(&d).flat_map(|v| v.to_le_bytes()).collect();
        let got = f32s(&Req(Vec::new()).u32(4).u32(4).u64(n as u64).bytes(&beta.to_le_bytes()).bytes(&cd).bytes(&acc).run(exe));
        let want: Vec<f32> = a.iter().zip(x).zip(&d).map(|((r, c), d)| beta * r + (1.0 - beta) * (c - d)).collect();
        prop_assert_eq!(canon(&got), canon(&bits(&want)));
        // to_bf16: exact bits, NaN payloads included (both sides keep them).
        let out = req(3).bytes(&src).run(exe);
        let got: Vec<u16> = out.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
        let want: Vec<u16> = x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
        prop_assert_eq!(got, want);
    });
}

/// f32 bits with every NaN made one value: an arithmetic NaN's payload is the
/// hardware's choice (x86 and the GPU propagate different ones), never data here.
fn canon(v: &[u32]) -> Vec<u32> {
    v.iter().map(|&b| if f32::from_bits(b).is_nan() { 0x7FC0_0000 } else { b }).collect()
}

fn quantize_matches_cpu(exe: &str) {
    proptest!(config(96), |(x in vector(), spec in spec_strategy(), r in rounding_strategy(), dtype in 0u32..3)| {
        // f16 tops out at 65504: scale into its range (subnormals included).
        let x: Vec<f32> = if dtype == 2 { x.iter().map(|v| v / 64.0).collect() } else { x };
        same_quantize(exe, &x, dtype, spec, r, NonFinite::Error);
    });
}

fn edge_cases(exe: &str) {
    let tiny = f32::from_bits(1);
    let inputs: Vec<Vec<f32>> = vec![
        vec![0.0; 33],
        vec![-0.0, 0.0, -0.0, 0.0, 0.0],
        vec![tiny, -tiny, 0.0, tiny],
        vec![f32::MAX, -f32::MAX, 1.0, -1.0, 0.5],
        vec![f32::MAX, f32::MAX, -3.0e38],
        vec![1.0, f32::NAN, 2.0, f32::INFINITY],
        vec![-2.5; 9],
        (0..9000).map(|i| ((i * 7919 % 10007) as f32 - 5000.0) * 1e-3).collect(),
    ];
    for x in &inputs {
        for gs in [1, 3, 16, 4096, 10_000] {
            for b in [Bits::Int4, Bits::Int8] {
                for s in [Scheme::Symmetric, Scheme::Asymmetric] {
                    let spec = QuantSpec::new(b, s, gs).unwrap();
                    // Propagate differs from Error only where an input is not finite.
                    let propagate = x.iter().any(|v| !v.is_finite());
                    for nf in
                        [NonFinite::Error, NonFinite::Propagate].into_iter().take(1 + usize::from(propagate))
                    {
                        same_quantize(exe, x, 0, spec, Rounding::NearestEven, nf);
                        same_quantize(exe, x, 0, spec, Rounding::Stochastic { seed: 42 }, nf);
                    }
                }
            }
        }
    }
}

fn dequant_matches_cpu(exe: &str) {
    proptest!(config(64), |(x in vector(), spec in spec_strategy(), add in any::<bool>())| {
        let o = cpu(Rounding::NearestEven);
        let q = quantize(&x, spec, &o).unwrap();
        let start: Vec<f32> = (0..x.len()).map(|i| if add { (i as f32 * 0.37).sin() } else { 0.0 }).collect();
        let want = if add {
            let mut a = start.clone();
            dequantize_add(&q, &mut a, &o).unwrap();
            a
        } else {
            dequantize(&q, &o).unwrap()
        };
        let acc: Vec<u8> = start.iter().flat_map(|v| v.to_le_bytes()).collect();
        let out = Req(Vec::new()).u32(3).u64(x.len() as u64).spec(spec).bytes(&payload(&q)).u32(u32::from(add)).bytes(&acc).run(exe);
        let got: Vec<u32> = out.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
        prop_assert_eq!(got, want.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
    });
}

fn reduce_matches_cpu(exe: &str) {
    let inputs = (1usize..=8, prop::collection::vec(spec_strategy(), 8), 0usize..1500, any::<u64>());
    proptest!(config(48), |((k, specs, len, seed) in inputs, out_spec in spec_strategy(), r in rounding_strategy())| {
        let qs = reduce_inputs(k, &specs, len, seed);
        let want = dequant_reduce_quant(&qs, out_spec, &cpu(r)).unwrap();
        let mut req = Req(Vec::new()).u32(2).u32(k as u32).u64(len as u64);
        for q in &qs {
            req = req.spec(q.spec()).bytes(&payload(q));
        }
        let out = req.out(out_spec, r).run(exe);
        prop_assert_eq!(reply(out_spec, len, &out, NonFinite::Error).unwrap(), want.to_bytes());
    });
}
