//! The GPU kernels (feature `cuda`) against the CPU scalar kernel, bit for bit:
//! wire bytes of quantize and of the fused kernel, f32 bits of dequantize and
//! dequantize-add, over lengths, group sizes, formats, dtypes and rounding modes;
//! wire round trips CPU -> GPU -> CPU; the non-finite error.
//!
//! One `#[test]` runs every check, so that without a device the run prints
//! exactly one counted line (`gpu: N tests skipped: no usable CUDA device (CUDA cuInit failed: ...)`).
//! With `ZEROPP_REQUIRE_GPU=1` a missing device is a failure instead.

use proptest::prelude::*;
use zeropp_quant::cuda::{Gpu, GpuElement, GpuQuantized};
use zeropp_quant::half::{bf16, f16};
use zeropp_quant::{
    Bits, Options, QuantError, QuantSpec, QuantizedRef, Rounding, Scheme, dequant_reduce_quant, dequantize,
    dequantize_add, encoded_len, quantize, quantize_to_wire,
};

use crate::common::{config, vector};
use crate::gpu_cases::{cpu, reduce_inputs, rounding_strategy, spec_strategy};

type Check = fn(&Gpu);

/// Every GPU check, by name.
const CHECKS: &[(&str, Check)] = &[
    (
        "quantize matches the CPU (f32, bf16, f16; INT8/INT4; sym/asym; nearest/stochastic)",
        quantize_matches_cpu,
    ),
    ("edge cases: zeros, subnormal max, range overflowing f32, large groups", edge_cases),
    ("many groups: more groups than blocks, INT4 odd group size with 2^20+5 elements", many_groups),
    ("dequantize and dequantize_add match the CPU", dequant_matches_cpu),
    ("dequant_reduce_quant matches the CPU (k = 1..8, mixed input specs)", reduce_matches_cpu),
    ("wire round trips CPU <-> GPU", wire_round_trips),
    ("non-finite input: the CPU's error, naming the same index", non_finite),
    ("reused output buffers (quantize_into, dequant_reduce_quant_into)", reuse_outputs),
    ("zero-length buffers: no allocation, no memset on a null pointer", zero_lengths),
    ("buffers read and dropped on a thread that never made the context current", other_threads),
    ("stream handles (new_stream) share the module and give the same bytes", stream_handles),
    (
        "the Hadamard rotation matches the CPU both ways (groups 1..8192, positions past 2^32 words)",
        hadamard_matches_cpu,
    ),
];

/// Allocations are padded to whole 4-byte words (the INT4 packing's atomics
/// write words), and a zero-byte allocation stays zero bytes.
#[test]
fn gpu_allocations_are_padded_to_whole_words() {
    use zeropp_quant::cuda::padded_bytes;
    for (bytes, padded) in [(0, 0), (1, 4), (3, 4), (4, 4), (5, 8), (33, 36), (1 << 20, 1 << 20)] {
        assert_eq!(padded_bytes(bytes), padded, "{bytes}");
    }
}

fn zero_lengths(gpu: &Gpu) {
    let z = gpu.zeros(0).unwrap();
    assert!(z.is_empty());
    assert_eq!(gpu.download(&z).unwrap(), Vec::<f32>::new());
    let x = gpu.upload::<f32>(&[]).unwrap();
    let q = gpu.quantize(&x, QuantSpec::int4(7).unwrap(), &Options::default()).unwrap();
    assert_eq!(
        q.to_bytes().unwrap(),
        quantize(&[0f32; 0], QuantSpec::int4(7).unwrap(), &Options::default()).unwrap().to_bytes()
    );
}

fn other_threads(gpu: &Gpu) {
    let x: Vec<f32> = (0..1000).map(|i| (i as f32).cos()).collect();
    let spec = QuantSpec::int4(9).unwrap();
    let q = gpu.quantize(&gpu.upload(&x).unwrap(), spec, &Options::default()).unwrap();
    let v = gpu.upload(&x).unwrap();
    let want = quantize(&x, spec, &Options::default()).unwrap().to_bytes();
    // A fresh thread has no current context: reading and dropping must set it.
    let got = std::thread::spawn(move || {
        let bytes = q.to_bytes();
        drop(v);
        drop(q);
        bytes
    })
    .join()
    .unwrap()
    .unwrap();
    assert_eq!(got, want);
}

fn stream_handles(gpu: &Gpu) {
    let other = gpu.new_stream().unwrap();
    assert_eq!(other.image(), gpu.image());
    let x: Vec<f32> = (0..4097).map(|i| (i as f32 * 0.01).sin()).collect();
    let spec = QuantSpec::int8(128).unwrap();
    let a = gpu.quantize(&gpu.upload(&x).unwrap(), spec, &Options::default()).unwrap();
    let b = std::thread::scope(|s| {
        s.spawn(|| other.quantize(&other.upload(&x).unwrap(), spec, &Options::default()).unwrap().to_bytes())
            .join()
            .unwrap()
            .unwrap()
    });
    assert_eq!(a.to_bytes().unwrap(), b);
}

#[test]
fn suite() {
    let banner = |gpu: &Gpu| {
        format!(
            "{} on driver {} ({})",
            gpu.device_name().unwrap_or_default(),
            gpu.driver_version().unwrap_or_default(),
            gpu.image()
        )
    };
    zeropp_tests::gpu::suite(Gpu::new(), banner, CHECKS);
}

/// The CPU reference options: the scalar kernel, one thread.
/// Quantizes `x` as `T` on both sides; the results (wire bytes, or the error)
/// must be identical.
fn same_quantize<T: GpuElement>(gpu: &Gpu, x: &[T], spec: QuantSpec, r: Rounding) {
    let o = cpu(r);
    let mut want = vec![0u8; encoded_len(spec, x.len())];
    let cpu_res = quantize_to_wire(x, spec, &o, &mut want);
    let got = gpu.upload(x).and_then(|v| gpu.quantize(&v, spec, &o));
    match (cpu_res, got) {
        (Ok(_), Ok(g)) => {
            let g = g.to_bytes().unwrap();
            if g != want {
                let at = g.iter().zip(&want).position(|(a, b)| a != b);
                panic!(
                    "GPU != CPU for {spec:?} {r:?} len {} ({}): first differing byte {at:?}",
                    x.len(),
                    std::any::type_name::<T>()
                );
            }
        }
        (Err(QuantError::NonFinite { index: a, .. }), Err(QuantError::NonFinite { index: b, .. })) => {
            assert_eq!(a, b, "non-finite index");
        }
        (c, g) => panic!("CPU {c:?} vs GPU {:?}", g.map(|q| q.len())),
    }
}

fn quantize_matches_cpu(gpu: &Gpu) {
    proptest!(config(256), |(x in vector(), spec in spec_strategy(), r in rounding_strategy(), dtype in 0u8..3)| {
        match dtype {
            0 => same_quantize(gpu, &x, spec, r),
            1 => same_quantize(gpu, &x.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>(), spec, r),
            // f16 tops out at 65504: scale into its range (2^-26 .. 2^14, subnormals included).
            _ => same_quantize(gpu, &x.iter().map(|&v| f16::from_f32(v / 64.0)).collect::<Vec<_>>(), spec, r),
        }
    });
}

fn all_specs(gs: usize) -> Vec<QuantSpec> {
    let mut v = Vec::new();
    for b in [Bits::Int4, Bits::Int8] {
        for s in [Scheme::Symmetric, Scheme::Asymmetric] {
            v.push(QuantSpec::new(b, s, gs).unwrap());
        }
    }
    v
}

fn edge_cases(gpu: &Gpu) {
    let tiny = f32::from_bits(1); // smallest subnormal: s = 8 / tiny overflows
    let inputs: Vec<Vec<f32>> = vec![
        vec![0.0; 33],
        vec![-0.0, 0.0, -0.0, 0.0, 0.0],
        vec![tiny, -tiny, 0.0, tiny],
        vec![f32::MAX, -f32::MAX, 1.0, -1.0, 0.5], // max - min overflows: the f64 path
        vec![f32::MAX, f32::MAX, -3.0e38],
        vec![1.0; 17],
        vec![-2.5; 9],
        (0..20_000).map(|i| ((i * 7919 % 10007) as f32 - 5000.0) * 1e-3).collect(),
    ];
    for x in &inputs {
        for gs in [1, 2, 3, 5, 16, 4096, 10_000, 20_000, 65_536] {
            for spec in all_specs(gs) {
                for r in [Rounding::NearestEven, Rounding::Stochastic { seed: 42 }] {
                    same_quantize(gpu, x, spec, r);
                }
            }
        }
    }
}

fn many_groups(gpu: &Gpu) {
    let n = (1 << 20) + 5;
    let x: Vec<f32> =
        (0..n).map(|i| ((i as u64 * 2_654_435_761 % 1_000_003) as f32 - 500_000.0) * 1e-4).collect();
    for (b, gs) in [(Bits::Int4, 1), (Bits::Int4, 3), (Bits::Int8, 1), (Bits::Int4, 2048)] {
        let spec = QuantSpec::new(b, Scheme::Asymmetric, gs).unwrap();
        same_quantize(gpu, &x, spec, Rounding::Stochastic { seed: 7 });
        same_quantize(gpu, &x, QuantSpec::new(b, Scheme::Symmetric, gs).unwrap(), Rounding::NearestEven);
    }
}

fn bits_of(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

fn hadamard_matches_cpu(gpu: &Gpu) {
    let g = prop::sample::select(vec![1usize, 2, 8, 32, 256, 1024, 8192]);
    let pos = prop_oneof![0u64..100_000, (1u64 << 37) - 5000..(1u64 << 37) + 5000];
    proptest!(config(64), |(x in vector(), g in g, seed: u64, pos in pos, inverse: bool)| {
        let h = zeropp_quant::Hadamard::new(g, seed).unwrap();
        let o = cpu(Rounding::NearestEven);
        let mut want = x.clone();
        if inverse { h.inverse(&mut want, pos, &o).unwrap() } else { h.forward(&mut want, pos, &o).unwrap() }
        let mut buf = gpu.upload(&x).unwrap().into_buffer();
        gpu.hadamard(&mut buf, &h, pos, inverse).unwrap();
        let got = gpu.download(&buf).unwrap();
        let canon = |v: &[f32]| v.iter().map(|f| if f.is_nan() { 0x7FC0_0000 } else { f.to_bits() }).collect::<Vec<u32>>();
        prop_assert_eq!(canon(&got), canon(&want));
    });
}

fn dequant_matches_cpu(gpu: &Gpu) {
    proptest!(config(128), |(x in vector(), spec in spec_strategy(), acc in vector())| {
        let o = cpu(Rounding::NearestEven);
        let q = quantize(&x, spec, &o).unwrap();
        let gq = gpu.upload_quantized(&q).unwrap();
        let d = gpu.dequantize(&gq).unwrap();
        prop_assert_eq!(bits_of(&gpu.download(&d).unwrap()), bits_of(&dequantize(&q, &o).unwrap()));
        // Accumulate onto arbitrary values (cycled to the length).
        let start: Vec<f32> = (0..x.len()).map(|i| acc.get(i % acc.len().max(1)).copied().unwrap_or(0.25)).collect();
        let mut want = start.clone();
        dequantize_add(&q, &mut want, &o).unwrap();
        let mut buf = gpu.upload(&start).unwrap().into_buffer();
        gpu.dequantize_add(&gq, &mut buf).unwrap();
        prop_assert_eq!(bits_of(&gpu.download(&buf).unwrap()), bits_of(&want));
        // A wrong-length destination is an error, not a crash.
        let mut short = gpu.zeros(x.len() + 1).unwrap();
        prop_assert!(gpu.dequantize_into(&gq, &mut short).is_err());
    });
}

fn reduce_matches_cpu(gpu: &Gpu) {
    let inputs = (1usize..=8, prop::collection::vec(spec_strategy(), 8), 0usize..2500, any::<u64>());
    proptest!(config(96), |((k, specs, len, seed) in inputs, out_spec in spec_strategy(), r in rounding_strategy())| {
        let o = cpu(r);
        let qs = reduce_inputs(k, &specs, len, seed);
        let want = dequant_reduce_quant(&qs, out_spec, &o).unwrap();
        let gqs: Vec<GpuQuantized> = qs.iter().map(|q| gpu.upload_quantized(q).unwrap()).collect();
        let refs: Vec<&GpuQuantized> = gqs.iter().collect();
        let got = gpu.dequant_reduce_quant(&refs, out_spec, &o).unwrap();
        prop_assert_eq!(got.to_bytes().unwrap(), want.to_bytes());
    });
}

fn wire_round_trips(gpu: &Gpu) {
    proptest!(config(64), |(x in vector(), spec in spec_strategy(), r in rounding_strategy())| {
        let o = cpu(r);
        // GPU -> CPU: the GPU's bytes decode on the CPU, and dequantize the same.
        let gq = gpu.quantize(&gpu.upload(&x).unwrap(), spec, &o).unwrap();
        let bytes = gq.to_bytes().unwrap();
        let view = QuantizedRef::from_bytes(&bytes).unwrap();
        let gpu_deq = gpu.download(&gpu.dequantize(&gq).unwrap()).unwrap();
        prop_assert_eq!(bits_of(&dequantize(&view, &o).unwrap()), bits_of(&gpu_deq));
        prop_assert_eq!(&gq.to_quantized().unwrap(), &quantize(&x, spec, &o).unwrap());
        // CPU -> GPU: received wire bytes feed the GPU kernels; back again unchanged.
        let back = gpu.upload_wire(&bytes).unwrap();
        prop_assert_eq!(back.to_bytes().unwrap(), bytes.clone());
        // Mixed: a CPU-quantized and a GPU-quantized input in one fused reduction.
        let cq = quantize(&x, spec, &o).unwrap();
        let out_spec = QuantSpec::int4(64).unwrap();
        let want = dequant_reduce_quant(&[cq.view(), view], out_spec, &o).unwrap();
        let cgq = gpu.upload_quantized(&cq).unwrap();
        let got = gpu.dequant_reduce_quant(&[&cgq, &back], out_spec, &o).unwrap();
        prop_assert_eq!(got.to_bytes().unwrap(), want.to_bytes());
    });
    // A corrupted header is refused before it reaches the device.
    let q = quantize(&[1.0f32, 2.0], QuantSpec::int8(2).unwrap(), &Options::default()).unwrap();
    let mut bytes = q.to_bytes();
    bytes[9] ^= 1;
    assert!(matches!(gpu.upload_wire(&bytes), Err(QuantError::Decode(_))));
}

fn non_finite(gpu: &Gpu) {
    for (len, bad) in [(10usize, 3usize), (5000, 4097), (5000, 0), (5000, 4999)] {
        for v in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut x: Vec<f32> = (0..len).map(|i| i as f32 * 0.01).collect();
            x[bad] = v;
            x[len - 1] = f32::NAN; // a later bad element must not be the one named
            if bad == len - 1 {
                x[bad] = v;
            }
            let spec = QuantSpec::int8(256).unwrap();
            let err = gpu.quantize(&gpu.upload(&x).unwrap(), spec, &Options::default()).unwrap_err();
            match err {
                QuantError::NonFinite { index, value } => {
                    assert_eq!(index, bad);
                    assert_eq!(value.is_nan(), x[bad].is_nan());
                    if !value.is_nan() {
                        assert_eq!(value, x[bad]);
                    }
                }
                e => panic!("expected NonFinite, got {e:?}"),
            }
            same_quantize(gpu, &x, spec, Rounding::NearestEven);
        }
    }
    // An overflowing sum in the fused kernel is the same error.
    let big = quantize(&[3.0e38f32, 1.0, -3.0e38], QuantSpec::int8(3).unwrap(), &Options::default()).unwrap();
    let g = gpu.upload_quantized(&big).unwrap();
    let err =
        gpu.dequant_reduce_quant(&[&g, &g], QuantSpec::int8(3).unwrap(), &Options::default()).unwrap_err();
    let want =
        dequant_reduce_quant(&[&big, &big], QuantSpec::int8(3).unwrap(), &Options::default()).unwrap_err();
    assert_eq!(format!("{err}"), format!("{want}"));
}

fn reuse_outputs(gpu: &Gpu) {
    let o = Options::default();
    // INT4 with an odd group size ORs nibbles: a reused buffer must be cleared first.
    for spec in [QuantSpec::new(Bits::Int4, Scheme::Asymmetric, 5).unwrap(), QuantSpec::int8(64).unwrap()] {
        let mut out = gpu.quantized_buffer(spec, 1001).unwrap();
        for seed in 0..3u64 {
            let x: Vec<f32> =
                (0..1001).map(|i| ((i as u64 * 7 + seed * 1_000_003) % 97) as f32 - 48.0).collect();
            gpu.quantize_into(&gpu.upload(&x).unwrap(), &o, &mut out).unwrap();
            assert_eq!(out.to_bytes().unwrap(), quantize(&x, spec, &o).unwrap().to_bytes());
            let q = quantize(&x, QuantSpec::int4(7).unwrap(), &o).unwrap();
            let g = gpu.upload_quantized(&q).unwrap();
            gpu.dequant_reduce_quant_into(&[&g, &g], &o, &mut out).unwrap();
            assert_eq!(
                out.to_bytes().unwrap(),
                dequant_reduce_quant(&[&q, &q], spec, &o).unwrap().to_bytes()
            );
        }
        let short = gpu.upload(&[1.0f32; 1000]).unwrap();
        assert!(matches!(gpu.quantize_into(&short, &o, &mut out), Err(QuantError::LengthMismatch { .. })));
    }
}
