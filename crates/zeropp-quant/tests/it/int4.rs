//! INT4 packing/unpacking across every available kernel: odd group sizes,
//! odd lengths, groups and tiles straddling the internal scratch blocks, and
//! odd start offsets (the fused kernel's tiles), all bit-identical to the
//! scalar reference.

use zeropp_quant::{
    Bits, Kernel, Options, QuantSpec, Rounding, Scheme, available_kernels, dequant_reduce_quant, dequantize,
    dequantize_add, quantize,
};

/// Deterministic values in about [-4, 4).
fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut st = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            st = st.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((st >> 40) as f32 / 16_777_216.0 - 0.5) * 8.0
        })
        .collect()
}

fn bits_of(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Independent sign-extending nibble decoder (even element in the high nibble).
fn nibble(data: &[u8], i: usize) -> i8 {
    let b = data[i / 2];
    let n = if i.is_multiple_of(2) { b >> 4 } else { b & 0x0F };
    ((n << 4) as i8) >> 4
}

#[test]
fn int4_kernels_match_scalar_on_odd_shapes() {
    let lens = [0usize, 1, 2, 3, 31, 33, 63, 64, 65, 127, 129, 4095, 4097, 8193, 9001, 20_003];
    let groups = [1usize, 3, 7, 33, 63, 65, 127, 4097, 9000];
    for (li, &len) in lens.iter().enumerate() {
        let x = values(len, li as u64 + 1);
        let neg: Vec<f32> = x.iter().map(|v| -v * 0.75).collect();
        for &gs in &groups {
            for scheme in [Scheme::Symmetric, Scheme::Asymmetric] {
                for rounding in [Rounding::NearestEven, Rounding::Stochastic { seed: 5 }] {
                    let sp = QuantSpec::new(Bits::Int4, scheme, gs).unwrap();
                    let base = Options::default().single_thread().with_rounding(rounding);
                    let s = base.with_kernel(Kernel::Scalar);
                    let q0 = quantize(&x, sp, &s).unwrap();
                    let q1 = quantize(&neg, sp, &s).unwrap();
                    // The scalar reference itself: dequantize == nibble * scale + offset.
                    let y0 = dequantize(&q0, &s).unwrap();
                    for (i, &y) in y0.iter().enumerate() {
                        let g = i / gs;
                        let off = q0.offsets().map_or(0.0, |o| o[g]);
                        let want = f32::from(nibble(q0.data(), i)) * q0.scales()[g] + off;
                        assert_eq!(y.to_bits(), want.to_bits(), "len={len} gs={gs} i={i}");
                    }
                    let mut acc0 = x.clone();
                    dequantize_add(&q0, &mut acc0, &s).unwrap();
                    let out_sp = QuantSpec::new(Bits::Int4, scheme, gs + 2).unwrap();
                    let r0 = dequant_reduce_quant(&[&q0, &q1, &q0], out_sp, &s).unwrap();
                    for k in available_kernels() {
                        let o = base.with_kernel(k);
                        let ctx = format!("kernel={k} len={len} gs={gs} {scheme:?} {rounding:?}");
                        let q = quantize(&x, sp, &o).unwrap();
                        assert_eq!(q.to_bytes(), q0.to_bytes(), "quantize {ctx}");
                        let y = dequantize(&q0, &o).unwrap();
                        assert_eq!(bits_of(&y), bits_of(&y0), "dequantize {ctx}");
                        let mut acc = x.clone();
                        dequantize_add(&q0, &mut acc, &o).unwrap();
                        assert_eq!(bits_of(&acc), bits_of(&acc0), "dequantize_add {ctx}");
                        let r = dequant_reduce_quant(&[&q0, &q1, &q0], out_sp, &o).unwrap();
                        assert_eq!(r.to_bytes(), r0.to_bytes(), "dequant_reduce_quant {ctx}");
                    }
                }
            }
        }
    }
}

/// On aarch64 the NEON kernel must be detected, so the checks above cover it.
#[test]
fn neon_detected_on_aarch64() {
    #[cfg(target_arch = "aarch64")]
    assert!(Kernel::Neon.is_available() && available_kernels().contains(&Kernel::Neon));
    #[cfg(not(target_arch = "aarch64"))]
    assert!(!Kernel::Neon.is_available());
    println!("kernels: {:?}", available_kernels());
}
