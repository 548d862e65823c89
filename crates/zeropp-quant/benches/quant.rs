//! Kernel throughput next to memcpy, in GB/s.
//!
//! Groups `quant/single_thread` and `quant/all_threads`; functions `memcpy`,
//! `quantize_int8`, `quantize_int4`, `dequantize_int8`,
//! `dequant_reduce_quant_k4`, `dequant_reduce_quant_k8`, and qgZ's group of
//! 256 with and without the Hadamard rotation (`quantize_int4_g256`,
//! `quantize_hadamard_int4_g256`, `dequantize_hadamard_int4_g256`); parameter = size
//! label (`64KiB`, `4MiB`, `256MiB`) of the f32 vector.
//!
//! Throughput counts f32-equivalent bytes processed: `len * 4` for quantize
//! (input) and dequantize (output), `k * len * 4` for the fused kernel (its k
//! INT4 inputs, each of the labelled size as f32). memcpy copies the labelled
//! number of bytes, so `kernel GB/s / memcpy GB/s` at the same label is the
//! ratio to report. Set `ZEROPP_BENCH_MAX_MIB` to skip larger sizes.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a test failure

use criterion::{BenchmarkId, Criterion, SamplingMode, Throughput, criterion_group, criterion_main};
use rayon::prelude::*;
use std::hint::black_box;
use std::time::Duration;
use zeropp_quant::hadamard::{dequantize_hadamard_into, quantize_hadamard_to_wire};
use zeropp_quant::{
    Hadamard, Options, QuantSpec, Quantized, QuantizedRef, dequant_reduce_quant_into, dequantize_into,
    encoded_len, quantize, quantize_into, tools,
};

const SIZES: [(&str, usize); 3] = [("64KiB", 64 << 10), ("4MiB", 4 << 20), ("256MiB", 256 << 20)];
const GROUP: usize = 2048;

fn bench(c: &mut Criterion) {
    let max_bytes = std::env::var("ZEROPP_BENCH_MAX_MIB")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .map_or(usize::MAX, |m| m << 20);
    let max_len = SIZES.iter().map(|s| s.1).filter(|&b| b <= max_bytes).max().unwrap_or(0) / 4;
    // Allocated once at the largest size; smaller sizes use prefixes.
    let input = tools::random_normalish(max_len, 1);
    let mut copy_dst = vec![0f32; max_len];
    let mut deq_out = vec![0f32; max_len];
    let int8 = QuantSpec::int8(GROUP).unwrap();
    let int4 = QuantSpec::int4(GROUP).unwrap();
    let reduce_inputs: Vec<Quantized> = (0..8)
        .map(|j| {
            let x = tools::random_normalish(max_len, 100 + j);
            quantize(&x, int4, &Options::default()).unwrap()
        })
        .collect();

    for (group_name, opts) in [
        ("quant/single_thread", Options::default().single_thread()),
        ("quant/all_threads", Options::default()),
    ] {
        let parallel = group_name.ends_with("all_threads");
        let mut g = c.benchmark_group(group_name);
        g.sample_size(10)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_secs(1))
            .sampling_mode(SamplingMode::Flat);
        for (label, bytes) in SIZES {
            if bytes > max_bytes {
                continue;
            }
            let len = bytes / 4;
            let x = &input[..len];
            g.throughput(Throughput::Bytes(bytes as u64));
            g.bench_function(BenchmarkId::new("memcpy", label), |b| {
                b.iter(|| {
                    let dst = &mut copy_dst[..len];
                    if parallel {
                        dst.par_chunks_mut(1 << 16)
                            .zip(x.par_chunks(1 << 16))
                            .for_each(|(d, s)| d.copy_from_slice(s));
                    } else {
                        dst.copy_from_slice(x);
                    }
                    black_box(&dst[len - 1]);
                });
            });
            let mut q8 = Quantized::zeroed(int8, len).unwrap();
            g.bench_function(BenchmarkId::new("quantize_int8", label), |b| {
                b.iter(|| quantize_into(black_box(x), &opts, &mut q8).unwrap());
            });
            let mut q4 = Quantized::zeroed(int4, len).unwrap();
            g.bench_function(BenchmarkId::new("quantize_int4", label), |b| {
                b.iter(|| quantize_into(black_box(x), &opts, &mut q4).unwrap());
            });
            g.bench_function(BenchmarkId::new("dequantize_int8", label), |b| {
                b.iter(|| dequantize_into(black_box(&q8), &mut deq_out[..len], &opts).unwrap());
            });
            // qgZ's format (INT4, groups of 256), plain and rotated (SDP4Bit's smoothing).
            let g256 = QuantSpec::int4(256).unwrap();
            let h = Hadamard::for_spec(&g256, 7).unwrap();
            let mut w256 = vec![0u8; encoded_len(g256, len)];
            g.bench_function(BenchmarkId::new("quantize_int4_g256", label), |b| {
                b.iter(|| zeropp_quant::quantize_to_wire(black_box(x), g256, &opts, &mut w256).unwrap());
            });
            g.bench_function(BenchmarkId::new("quantize_hadamard_int4_g256", label), |b| {
                b.iter(|| quantize_hadamard_to_wire(black_box(x), g256, &h, 0, &opts, &mut w256).unwrap());
            });
            quantize_hadamard_to_wire(x, g256, &h, 0, &opts, &mut w256).unwrap();
            let rotated = QuantizedRef::from_bytes(&w256).unwrap();
            g.bench_function(BenchmarkId::new("dequantize_hadamard_int4_g256", label), |b| {
                b.iter(|| {
                    dequantize_hadamard_into(black_box(&rotated), &mut deq_out[..len], &h, 0, &opts).unwrap()
                });
            });
            // Fused kernel over INT4 inputs of `len` elements each (prefix views
            // are re-quantized slices of the big inputs).
            let small: Vec<Quantized> = if len == max_len {
                Vec::new()
            } else {
                reduce_inputs
                    .iter()
                    .map(|q| {
                        let mut y = vec![0f32; len];
                        let full = zeropp_quant::dequantize(q, &Options::default()).unwrap();
                        y.copy_from_slice(&full[..len]);
                        quantize(&y, int4, &Options::default()).unwrap()
                    })
                    .collect()
            };
            let ins: &[Quantized] = if small.is_empty() { &reduce_inputs } else { &small };
            let mut out = Quantized::zeroed(int4, len).unwrap();
            for k in [4usize, 8] {
                g.throughput(Throughput::Bytes((k * bytes) as u64));
                g.bench_function(BenchmarkId::new(format!("dequant_reduce_quant_k{k}"), label), |b| {
                    b.iter(|| dequant_reduce_quant_into(black_box(&ins[..k]), &opts, &mut out).unwrap());
                });
            }
        }
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
