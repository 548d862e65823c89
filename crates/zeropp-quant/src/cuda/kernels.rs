//! [`Gpu`]'s quantization kernels on owned buffers: quantize, the fused
//! dequantize-reduce-requantize, dequantize and dequantize-add, each bit-exact
//! against the CPU's scalar kernel.

use super::*;

impl Gpu {
    /// Quantizes `x` group by group, like [`crate::quantize`] (only
    /// `opts.rounding` is read: the kernel and threading options are CPU ones).
    ///
    /// Errors with [`QuantError::NonFinite`] naming the first NaN/±Inf element.
    pub fn quantize<T: GpuElement>(
        &self,
        x: &GpuVec<T>,
        spec: QuantSpec,
        opts: &Options,
    ) -> Result<GpuQuantized> {
        let mut out = self.quantized_buffer(spec, x.len())?;
        self.quantize_into(x, opts, &mut out)?;
        Ok(out)
    }

    /// [`Gpu::quantize`] into `out` (its spec is the format; its length must
    /// equal `x.len()`), without allocating the output.
    pub fn quantize_into<T: GpuElement>(
        &self,
        x: &GpuVec<T>,
        opts: &Options,
        out: &mut GpuQuantized,
    ) -> Result<()> {
        if out.len != x.len() {
            return Err(QuantError::LengthMismatch {
                what: "quantize_into output",
                expected: x.len(),
                actual: out.len,
            });
        }
        self.current()?;
        // SAFETY: `x` holds `out.len` live values of `T` (checked above) and `out`
        // a live encoding of its spec and length, both made on this context.
        unsafe { self.launch_quantize::<T>(x.buf.as_device_ptr().as_raw(), opts, out.at()) }
    }

    /// The quantize kernel of [`Gpu::quantize_into`] and [`Gpu::quantize_at`]
    /// (the header is the callers'), synchronized.
    ///
    /// # Safety
    ///
    /// As [`Gpu::quantize_at`]; the context is current.
    pub(super) unsafe fn launch_quantize<T: GpuElement>(
        &self,
        src: u64,
        opts: &Options,
        out: WireAt,
    ) -> Result<()> {
        self.run_quantize(
            out,
            opts,
            |bad| self.value(T::VALUE, src, None, bad),
            |m, a| {
                let f = m.get_function(T::QUANTIZE)?;
                let stream = &self.stream;
                let (grid, block) = (a.grid, BLOCK);
                // SAFETY: the argument list matches `zq_quantize_*`'s parameters in
                // order and type (device addresses as u64); every address points
                // into a live buffer of the sizes the kernel indexes (`len` inputs,
                // the output's wire layout, one u64) by this function's contract.
                unsafe {
                    launch!(f<<<grid, block, 0, stream>>>(
                        src, a.len, a.gs, a.bits, a.asym, a.stochastic, a.seed, a.atomic_pack, a.propagate,
                        a.scales, a.offsets, a.data, a.bad
                    ))?;
                }
                Ok(())
            },
        )
    }

    /// The fused qgZ kernel, like [`crate::dequant_reduce_quant`]: dequantizes
    /// the inputs (equal lengths, any specs), sums them in f32 in input order and
    /// requantizes with `out_spec`.
    pub fn dequant_reduce_quant(
        &self,
        inputs: &[&GpuQuantized],
        out_spec: QuantSpec,
        opts: &Options,
    ) -> Result<GpuQuantized> {
        let len = inputs.first().ok_or(QuantError::NoInputs)?.len;
        let mut out = self.quantized_buffer(out_spec, len)?;
        self.dequant_reduce_quant_into(inputs, opts, &mut out)?;
        Ok(out)
    }

    /// [`Gpu::dequant_reduce_quant`] into `out` (its spec is the output spec;
    /// its length must equal the inputs'), without allocating the output.
    pub fn dequant_reduce_quant_into(
        &self,
        inputs: &[&GpuQuantized],
        opts: &Options,
        out: &mut GpuQuantized,
    ) -> Result<()> {
        let len = inputs.first().ok_or(QuantError::NoInputs)?.len;
        for q in inputs.iter().chain(std::iter::once(&&*out)) {
            if q.len != len {
                return Err(QuantError::LengthMismatch {
                    what: "dequant_reduce_quant input or output",
                    expected: len,
                    actual: q.len,
                });
            }
        }
        self.current()?;
        let inputs: Vec<WireAt> = inputs.iter().map(|q| q.at()).collect();
        // SAFETY: every input and `out` is a live encoding of its spec and length
        // (all `len`, checked above), made on this context.
        unsafe { self.launch_reduce_quantize(&inputs, opts, out.at()) }
    }

    /// The fused kernel of [`Gpu::dequant_reduce_quant_into`] and
    /// [`Gpu::dequant_reduce_quant_at`] (the header is the callers'), synchronized.
    ///
    /// # Safety
    ///
    /// As [`Gpu::dequant_reduce_quant_at`]; the context is current.
    pub(super) unsafe fn launch_reduce_quantize(
        &self,
        inputs: &[WireAt],
        opts: &Options,
        out: WireAt,
    ) -> Result<()> {
        let host: Vec<InDesc> = inputs.iter().map(|q| desc_at(q.addr, &q.spec, q.len)).collect();
        // The descriptors go to a reused buffer on this stream (no allocation per
        // call once it is large enough); `run_quantize` synchronizes the stream
        // before `host` and the lock go away.
        let mut descs = self.descs.lock().unwrap_or_else(PoisonError::into_inner);
        if descs.len() < host.len() {
            *descs = alloc::<InDesc>(host.len().next_power_of_two())?;
        }
        let mut window = descs.index(..host.len());
        // SAFETY: `window` holds `host.len()` descriptors of a live allocation;
        // the copy is ordered before the kernel on this stream, and the stream is
        // synchronized before `host` is dropped.
        unsafe { window.async_copy_from(&host[..], &self.stream)? };
        let (din, k) = (window.as_device_ptr().as_raw(), inputs.len() as u32);
        self.run_quantize(
            out,
            opts,
            |bad| self.value("zq_value_sum", din, Some(k), bad),
            |m, a| {
                let f = m.get_function("zq_reduce_quantize")?;
                let stream = &self.stream;
                let (grid, block) = (a.grid, BLOCK);
                // SAFETY: the arguments match `zq_reduce_quantize`'s parameters;
                // `din` holds `k` descriptors of live encodings of length `len`, and
                // the output addresses are live, by this function's contract.
                unsafe {
                    launch!(f<<<grid, block, 0, stream>>>(
                        din, k, a.len, a.gs, a.bits, a.asym, a.stochastic, a.seed, a.atomic_pack, a.propagate,
                        a.scales, a.offsets, a.data, a.bad
                    ))?;
                }
                Ok(())
            },
        )
    }

    /// Shared part of the quantizing calls: arguments, launch, synchronisation
    /// and the non-finite policy (the first non-finite element's error, or,
    /// under [`crate::NonFinite::Propagate`], poisoned groups written by the
    /// kernel as the CPU kernels write them).
    fn run_quantize(
        &self,
        out: WireAt,
        opts: &Options,
        value_at: impl Fn(u64) -> Result<f32>,
        launch_fn: impl Fn(&Module, &QuantLaunch) -> Result<()>,
    ) -> Result<()> {
        let propagate = opts.non_finite == crate::spec::NonFinite::Propagate;
        if out.len == 0 {
            return Ok(());
        }
        let spec = out.spec;
        let d = desc_at(out.addr, &spec, out.len);
        let atomic_pack = spec.bits() == Bits::Int4 && spec.group_size() % 2 == 1;
        if atomic_pack {
            // INT4 with an odd group size ORs each group's nibbles into the data,
            // word by word: the data must start 4-byte aligned and be zeroed.
            if !d.data.is_multiple_of(4) {
                return Err(QuantError::Cuda(cust::error::CudaError::InvalidValue));
            }
            // SAFETY: `d.data` addresses the output's data region of `⌈len/2⌉`
            // bytes in live device memory (the callers' contract); the slice
            // does not own it (dropping it frees nothing). The memset is ordered
            // on this stream before the kernel.
            unsafe {
                let mut data = DeviceSlice::from_raw_parts_mut(
                    DevicePointer::<u8>::from_raw(d.data),
                    out.len.div_ceil(2),
                );
                data.set_zero_async(&self.stream)?;
            }
        }
        // All ones = u64::MAX: no non-finite element seen yet. Ordered on this
        // stream (the previous call's read-back finished before it returned).
        // SAFETY: `bad` is a live allocation of this context.
        unsafe { self.bad.index(..).set_8_async(0xFF, &self.stream)? };
        let (stochastic, seed) = match opts.rounding {
            Rounding::Stochastic { seed } => (1u32, seed),
            Rounding::NearestEven => (0u32, 0u64),
        };
        let groups = spec.num_groups(out.len);
        let a = QuantLaunch {
            grid: groups.min(MAX_BLOCKS) as u32,
            len: out.len as u64,
            gs: spec.group_size() as u32,
            bits: spec.bits().bits(),
            asym: u32::from(spec.scheme().has_offsets()),
            stochastic,
            seed,
            atomic_pack: u32::from(atomic_pack),
            propagate: u32::from(propagate),
            scales: d.scales,
            offsets: d.offsets,
            data: d.data,
            bad: self.bad.as_device_ptr().as_raw(),
        };
        launch_fn(&self.module, &a)?;
        let mut first = [0u64];
        // SAFETY: `first` outlives the copy: the stream is synchronized next.
        unsafe { self.bad.async_copy_to(&mut first[..], &self.stream)? };
        self.stream.synchronize()?;
        let first_bad = first[0];
        if first_bad != u64::MAX && !propagate {
            let value = value_at(first_bad)?;
            return Err(QuantError::NonFinite { index: first_bad as usize, value });
        }
        Ok(())
    }

    /// Element `i` of a quantize source as f32 (`k` inputs for the fused kernel).
    fn value(&self, kernel: &str, src: u64, k: Option<u32>, i: u64) -> Result<f32> {
        // Only on the error path: a synchronous allocation is fine here.
        let out = DeviceBox::new(&0f32)?;
        let o = out.as_device_ptr().as_raw();
        let f = self.module.get_function(kernel)?;
        let stream = &self.stream;
        // SAFETY: `zq_value_*(src, i, out)` / `zq_value_sum(in, k, i, out)`: `i`
        // is an index the quantize kernel just read from `src`, `out` one f32.
        unsafe {
            match k {
                Some(k) => launch!(f<<<1, 1, 0, stream>>>(src, k, i, o))?,
                None => launch!(f<<<1, 1, 0, stream>>>(src, i, o))?,
            }
        }
        self.stream.synchronize()?;
        let mut v = 0f32;
        out.copy_to(&mut v)?;
        Ok(v)
    }

    /// Dequantizes into a new device buffer, like [`crate::dequantize`] (drop
    /// it where this GPU's context is current).
    pub fn dequantize(&self, q: &GpuQuantized) -> Result<DeviceBuffer<f32>> {
        self.current()?;
        // The kernel writes every element.
        let mut out = alloc::<f32>(q.len)?;
        self.dequant(q, &mut out, false)?;
        Ok(out)
    }

    /// Dequantizes into `out` (length `q.len()`), like [`crate::dequantize_into`].
    pub fn dequantize_into(&self, q: &GpuQuantized, out: &mut DeviceSlice<f32>) -> Result<()> {
        self.current()?;
        self.dequant(q, out, false)
    }

    /// Accumulates the dequantized values into `acc` (`acc[i] += x̂[i]` in f32),
    /// like [`crate::dequantize_add`].
    pub fn dequantize_add(&self, q: &GpuQuantized, acc: &mut DeviceSlice<f32>) -> Result<()> {
        self.current()?;
        self.dequant(q, acc, true)
    }

    /// Rotates every whole group of `x` in place, like [`Hadamard::forward`]
    /// (`inverse`: [`Hadamard::inverse`]) with `x[0]` at stream position
    /// `position`, bit for bit; synchronized.
    pub fn hadamard(
        &self,
        x: &mut DeviceSlice<f32>,
        h: &Hadamard,
        position: u64,
        inverse: bool,
    ) -> Result<()> {
        self.current()?;
        // SAFETY: `x` holds `x.len()` live f32 on this context.
        unsafe { self.hadamard_at(x.as_device_ptr().as_raw(), x.len(), h, position, inverse)? };
        self.stream.synchronize()?;
        Ok(())
    }

    fn dequant(&self, q: &GpuQuantized, out: &mut DeviceSlice<f32>, add: bool) -> Result<()> {
        if out.len() != q.len {
            return Err(QuantError::LengthMismatch {
                what: "dequantize output",
                expected: q.len,
                actual: out.len(),
            });
        }
        if q.len == 0 {
            return Ok(());
        }
        // SAFETY: `q` is a live encoding on this context and `out` holds `q.len`
        // live f32 (checked above).
        unsafe { self.dequantize_at(q.at(), out.as_device_ptr().as_raw(), add)? };
        self.stream.synchronize()?;
        Ok(())
    }
}

/// The shared arguments of the quantize kernels (`QuantArgs` in the `.cu` file).
struct QuantLaunch {
    grid: u32,
    len: u64,
    gs: u32,
    bits: u32,
    asym: u32,
    stochastic: u32,
    seed: u64,
    atomic_pack: u32,
    propagate: u32,
    scales: u64,
    offsets: u64,
    data: u64,
    bad: u64,
}
