//! [`Gpu`]'s `*_at` calls on caller-managed device addresses (zeropp-comm's
//! device collectives keep many encodings in one buffer), and the element-wise
//! kernels of its reductions ([`Elementwise`]).

use super::*;

/// Calls on caller-managed device memory, by address (the `*_at` family), for
/// callers that keep many vectors and encodings in one allocation and order
/// work with events on [`Gpu::stream`]: zeropp-comm's device collectives. Each
/// `Gpu` has its own stream, so one `Gpu` per rank thread gives each rank its
/// own stream on the device's primary context.
impl Gpu {
    /// Enqueues the copy of `header` (`out`'s wire header: 32 bytes of metadata,
    /// not payload) on the stream; `header` must live until the stream is
    /// synchronized (the quantizing calls do before returning).
    fn write_header_at(&self, out: WireAt, header: &mut [u8; wire::HEADER_LEN]) -> Result<()> {
        wire::write_header(header, &out.spec, out.len)?;
        // SAFETY: `out.addr` starts a live region of at least HEADER_LEN bytes (the
        // callers' contract); the slice does not own it; `header` outlives the
        // copy: CUDA stages a copy from pageable memory before the call returns,
        // and the callers synchronize the stream before returning anyway.
        unsafe {
            let mut dst =
                DeviceSlice::from_raw_parts_mut(DevicePointer::<u8>::from_raw(out.addr), header.len());
            dst.async_copy_from(&header[..], &self.stream)?;
        }
        Ok(())
    }

    /// [`Gpu::quantize_into`] on addresses: quantizes the `out.len` values of `T`
    /// at `src` into the encoding `out` (header written too). Synchronizes the
    /// stream (the non-finite check reads one flag back). With INT4 and an odd
    /// group size the data region must be 4-byte aligned, else
    /// `QuantError::Cuda(InvalidValue)`.
    ///
    /// # Safety
    ///
    /// `src` must address `out.len` live values of `T` and `out.addr`
    /// `encoded_len(out.spec, out.len)` live bytes, both on this context, with no
    /// other work writing them meanwhile.
    pub unsafe fn quantize_at<T: GpuElement>(&self, src: u64, opts: &Options, out: WireAt) -> Result<()> {
        self.current()?;
        let mut header = [0u8; wire::HEADER_LEN];
        self.write_header_at(out, &mut header)?;
        // SAFETY: this function's contract.
        unsafe { self.launch_quantize::<T>(src, opts, out) }
    }

    /// [`Gpu::dequant_reduce_quant_into`] on addresses (header written too);
    /// synchronizes the stream.
    ///
    /// # Safety
    ///
    /// Every input and `out` must address live encodings of their specs and
    /// lengths on this context (all lengths equal `out.len`).
    pub unsafe fn dequant_reduce_quant_at(
        &self,
        inputs: &[WireAt],
        opts: &Options,
        out: WireAt,
    ) -> Result<()> {
        if inputs.is_empty() {
            return Err(QuantError::NoInputs);
        }
        if let Some(bad) = inputs.iter().find(|q| q.len != out.len) {
            return Err(QuantError::LengthMismatch {
                what: "dequant_reduce_quant_at input",
                expected: out.len,
                actual: bad.len,
            });
        }
        self.current()?;
        let mut header = [0u8; wire::HEADER_LEN];
        self.write_header_at(out, &mut header)?;
        // SAFETY: this function's contract.
        unsafe { self.launch_reduce_quantize(inputs, opts, out) }
    }

    /// Dequantizes the encoding `q` into the `q.len` f32 at `out` (or adds to
    /// them), enqueued on the stream without waiting.
    ///
    /// # Safety
    ///
    /// `q` must address a live encoding and `out` `q.len` live f32 on this context.
    pub unsafe fn dequantize_at(&self, q: WireAt, out: u64, add: bool) -> Result<()> {
        if q.len == 0 {
            return Ok(());
        }
        self.current()?;
        let d = desc_at(q.addr, &q.spec, q.len);
        let grid = q.spec.num_groups(q.len).min(MAX_BLOCKS) as u32;
        let (len, add) = (q.len as u64, u32::from(add));
        let f = self.module.get_function("zq_dequant")?;
        let stream = &self.stream;
        // SAFETY: the arguments match `zq_dequant`'s parameters; the addresses are
        // live by this function's contract.
        unsafe {
            launch!(f<<<grid, BLOCK, 0, stream>>>(d.data, d.scales, d.offsets, d.group_size, d.bits, len, out, add))?;
        }
        Ok(())
    }

    /// The Hadamard rotation ([`crate::hadamard`]) of every whole group of the
    /// `n` f32 at `x`, in place (`x[0]` at stream position `position`; forward,
    /// or back when `inverse`), bit-identical to [`Hadamard::forward`] and
    /// [`Hadamard::inverse`]; enqueued on the stream without waiting.
    ///
    /// # Safety
    ///
    /// `x` must address `n` live f32 on this context.
    pub unsafe fn hadamard_at(
        &self,
        x: u64,
        n: usize,
        h: &Hadamard,
        position: u64,
        inverse: bool,
    ) -> Result<()> {
        let g = h.group_size();
        if n < g {
            return Ok(());
        }
        self.current()?;
        let grid = (n / g).min(MAX_BLOCKS) as u32;
        let f = self.module.get_function("zq_hadamard")?;
        let stream = &self.stream;
        let (n, g, seed, scale, inv) = (n as u64, g as u32, h.seed(), h.scale(), u32::from(inverse));
        // SAFETY: the arguments match `zq_hadamard`'s parameters in order and
        // type; `x` is live by this function's contract.
        unsafe {
            launch!(f<<<grid, BLOCK, 0, stream>>>(x, n, g, position, seed, scale, inv))?;
        }
        Ok(())
    }

    /// Runs an element-wise kernel over `n` elements, enqueued on the stream
    /// without waiting.
    ///
    /// # Safety
    ///
    /// Every address in `op` must point to `n` live elements of its type on
    /// this context.
    pub unsafe fn elementwise_at(&self, op: Elementwise, n: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        self.current()?;
        let grid = n.div_ceil(BLOCK as usize).min(MAX_BLOCKS) as u32;
        let stream = &self.stream;
        let n = n as u64;
        // SAFETY: (every arm) the arguments match the kernel's parameters in
        // order and type; the addresses are live by this function's contract.
        unsafe {
            match op {
                Elementwise::AddF32 { src, acc } => {
                    let f = self.module.get_function("zq_add_f32")?;
                    launch!(f<<<grid, BLOCK, 0, stream>>>(src, n, acc))?;
                }
                Elementwise::AddBf16 { src, acc } => {
                    let f = self.module.get_function("zq_add_bf16")?;
                    launch!(f<<<grid, BLOCK, 0, stream>>>(src, n, acc))?;
                }
                Elementwise::DivF32 { x, by } => {
                    let f = self.module.get_function("zq_div_f32")?;
                    launch!(f<<<grid, BLOCK, 0, stream>>>(x, n, by))?;
                }
                Elementwise::Feedback { comp, deq, res, beta } => {
                    let f = self.module.get_function("zq_feedback")?;
                    let k = 1.0f32 - beta;
                    launch!(f<<<grid, BLOCK, 0, stream>>>(comp, deq, res, n, beta, k))?;
                }
                Elementwise::ToBf16 { src, out } => {
                    let f = self.module.get_function("zq_to_bf16")?;
                    launch!(f<<<grid, BLOCK, 0, stream>>>(src, n, out))?;
                }
            }
        }
        Ok(())
    }
}
