//! A step on the device: the blocks (GEMMs, norms, RoPE, attention, the fused residuals), the
//! caption refinement, the items' preparation, and the whole step enqueued at once (captured as
//! a graph where it repeats).

use super::*;

impl CudaDit {
    /// `a[r, 0..k) · Wᵀ` for block plane `w` (`n × k`) and the activation rows `a` where
    /// [`Work::gemm_input`] put them: in 8 bits where the plane is 8-bit,
    /// else bf16 from `hb`. Returns where the rows are: bf16 rows `[r, n]` at `out`, or, on the
    /// int8 path where `sums` allows (a consumer that reads them: swiglu, residual_norm), the
    /// s32 sums in `work.acc` with their scales.
    pub(super) fn block_gemm(
        &self,
        work: &Work,
        w: &Plane,
        (n, k): (usize, usize),
        r: usize,
        out: u64,
        sums: bool,
    ) -> DResult<GemmRows> {
        if let (Some((xq, xs)), Plane::Q8(p)) = (work.q8_input(w), w) {
            let g8 = self
                .gemm8
                .as_ref()
                .expect("8-bit planes exist only with Gemm8");
            match g8 {
                Gemm8::Fp8(g, fast) => {
                    let to = Fp8Out::Bf16(out);
                    g.gemm(p.q.ptr(), p.s.ptr(), xq, xs, to, (n, r, k), n, *fast)?;
                }
                Gemm8::Int8(g) => {
                    let acc = work.acc.as_ref().expect("int8 work has its sums").ptr();
                    g.sums(p.q.ptr(), xq, acc, (n, r, k))?;
                    if sums {
                        let ws = p.s.ptr();
                        return Ok(GemmRows::S32 { acc, xs, ws });
                    }
                    g.scale(acc, (n, r), xs, p.s.ptr(), out, n)?;
                }
            }
        } else {
            let Plane::Bf16(w) = w else {
                return Err(DevError(
                    "an 8-bit plane without 8-bit activation buffers".into(),
                ));
            };
            self.blas
                .gemm_bf16_out(w.ptr(), work.hb.ptr(), out, n, r, k, n)?;
        }
        Ok(GemmRows::Bf16(out))
    }

    /// q/k RMSNorm + RoPE of block `b`'s q|k|v rows: K (to f16, or e4m3 for the FP8 attention,
    /// whose V maxima `a8` also gets), Q where the attention does not make it from the rows
    /// (`q_rows` None), V's copy where `v_copy`. k_norm_rope where only K and the maxima are
    /// needed, else qk_norm_rope over every unit (q, k, v heads) that needs work.
    pub(super) fn norm_rope(
        &self,
        b: &Block,
        w: &Work,
        p: &Pass,
        a8: Option<&Attn8Bufs>,
        v_copy: bool,
        q_rows: Option<QRows>,
    ) -> DResult<()> {
        let g = &self.geo;
        let (nh, hd, r) = (g.n_heads, g.head_dim(), p.rows);
        let (amax, q8, qsc, k8) = match a8 {
            Some(a8) => {
                if p.segs.len() > Attn8Bufs::SEGS {
                    return Err(DevError(format!(
                        "FP8 attention: {} items in one pass, at most {}",
                        p.segs.len(),
                        Attn8Bufs::SEGS
                    )));
                }
                self.dev.memset0(a8.amax.ptr(), p.segs.len() * nh * 4)?;
                (a8.amax.ptr(), a8.q8.ptr(), a8.qsc.ptr(), a8.k8.ptr())
            }
            None => (0, 0, 0, 0),
        };
        match (&self.k.k_norm_rope, q_rows.is_some() && !v_copy) {
            (Some(f), true) => {
                let kchunks = nh.div_ceil(256 / hd).div_ceil(KR_G);
                let chunks = kchunks * if a8.is_some() { 2 } else { 1 };
                self.launch(
                    f,
                    (chunks as u32, r.div_ceil(KR_ROWS) as u32, 1),
                    32 * KR_ROWS as u32,
                    0,
                    &[
                        Arg::Ptr(w.qkv.ptr()),
                        Arg::Ptr(b.norm_k.ptr()),
                        Arg::F32(g.qk_eps),
                        Arg::Ptr(p.cos),
                        Arg::Ptr(p.sin),
                        Arg::Ptr(p.map),
                        Arg::I32(nh as i32),
                        Arg::I32(r as i32),
                        Arg::I32(kchunks as i32),
                        Arg::Ptr(w.kc.ptr()),
                        Arg::Ptr(k8),
                        Arg::F32(1.0 / b.k8_scale),
                        Arg::Ptr(amax),
                    ],
                )?;
            }
            _ => {
                let units = if v_copy || a8.is_some() {
                    3 * nh
                } else {
                    2 * nh
                } - if q_rows.is_some() { nh } else { 0 };
                self.launch(
                    &self.k.qk_norm_rope,
                    (
                        units.div_ceil(256 / hd).div_ceil(4) as u32,
                        r.div_ceil(QKR_ROWS) as u32,
                        1,
                    ),
                    128,
                    0,
                    &[
                        Arg::Ptr(w.qkv.ptr()),
                        Arg::Ptr(b.norm_q.ptr()),
                        Arg::Ptr(b.norm_k.ptr()),
                        Arg::F32(g.qk_eps),
                        Arg::Ptr(p.cos),
                        Arg::Ptr(p.sin),
                        Arg::Ptr(p.map),
                        Arg::I32(nh as i32),
                        Arg::I32(r as i32),
                        Arg::Ptr(w.q.ptr()),
                        Arg::Ptr(w.kc.ptr()),
                        Arg::Ptr(if v_copy { w.vc.ptr() } else { 0 }),
                        Arg::Ptr(amax),
                        Arg::Ptr(q8),
                        Arg::Ptr(qsc),
                        Arg::Ptr(k8),
                        Arg::F32(1.0 / b.k8_scale),
                        Arg::I32(self.k.attn.q_f16() as i32),
                        Arg::I32(self.k.attn.v_bf16() as i32),
                        Arg::I32(q_rows.is_some() as i32),
                    ],
                )?;
            }
        }
        Ok(())
    }

    /// Runs `blocks` over a pass; `mods[i]` is block i's modulation slice (0: unmodulated).
    pub(super) fn run_blocks(
        &self,
        blocks: &[Block],
        mods: &[u64],
        mod_stride: usize,
        p: &Pass,
        w: &Work,
    ) -> DResult<()> {
        let g = &self.geo;
        let (d, f, nh, hd) = (g.dim, g.ffn, g.n_heads, g.head_dim());
        let r = p.rows;
        debug_assert!(r <= w.rows);
        let rows = |modulation: u64| NormRows {
            x: p.x,
            rows: r,
            d,
            eps: g.norm_eps,
            modulation,
            mod_stride,
            map: p.map,
        };
        // The FP8 attention, where loaded and every item is long enough for it.
        let attn8 = match (&self.k.attn8, &w.attn8) {
            (Some(k8), Some(b)) if p.segs.iter().all(|sg| sg.l >= k8.min_keys) => Some((k8, b)),
            _ => None,
        };
        // A modulated block's norm weights are folded into its modulation (ada_finish).
        let norm_w = |modulation: u64, w: &DBuf| if modulation != 0 { 0 } else { w.ptr() };
        let first = &blocks[0];
        let t = self.prof_start()?;
        let out = w.gemm_input(&first.qkv);
        dit_rows::rms_mod(
            &self.dev,
            &self.k.rows,
            &rows(mods[0]),
            norm_w(mods[0], &first.n1),
            0,
            out,
        )?;
        self.prof_stop(t, ROWS)?;
        let scale = 1.0 / (hd as f32).sqrt();
        for (i, b) in blocks.iter().enumerate() {
            let m = mods[i];
            // x += gate · rmsnorm(o) · norm, then the next GEMM's pre-norm of x.
            let residual = |o: GemmRows, norm: &DBuf, gate_slot: i32, next: Option<NextNorm>| {
                let o = (o, norm_w(m, norm));
                dit_rows::residual_norm(&self.dev, &self.k.rows, &rows(m), o, gate_slot, next)
            };
            let t = self.prof_start()?;
            let qkv_out = w.qkv.ptr();
            self.block_gemm(w, &b.qkv, (3 * d, d), r, qkv_out, false)?;
            self.prof_stop(t, GEMM)?;
            let t = self.prof_start()?;
            // Where V goes. The FP8 attention (attn8_prep) and attn_full_ws read it from the
            // q|k|v rows, the latter where every item's keys are consecutive rows; otherwise
            // qk_norm_rope copies it to vc (bf16 for attn_full_ws, f16 for the older kernels).
            let ws_rows = self.k.attn.v_bf16() && p.segs.iter().all(Seg::keys_contiguous);
            let v_copy = attn8.is_none() && !ws_rows;
            // The attention makes Q itself from the rows: attn_full_ws (f16) and attn_full_ws8
            // (e4m3 with a scale per row and head, as qk_norm_rope encodes it).
            let q_rows = (attn8.is_some() || self.k.attn.q_f16()).then_some(QRows {
                ld: 3 * d,
                norm: b.norm_q.ptr(),
                eps: g.qk_eps,
                cos: p.cos,
                sin: p.sin,
                map: p.map,
            });
            self.norm_rope(b, w, p, attn8.map(|(_, a8)| a8), v_copy, q_rows)?;
            self.prof_stop(t, ROWS)?;
            let t = self.prof_start()?;
            // The FP8 attention writes the O GEMM's e4m3 input itself when that GEMM runs in FP8.
            let fp8_gemms = matches!(self.gemm8, Some(Gemm8::Fp8(..)));
            let o_e4m3 = attn8.and(w.q8_input(&b.out).filter(|_| fp8_gemms));
            if let Some((_, a8)) = attn8 {
                let vt: usize = p
                    .segs
                    .iter()
                    .map(|sg| sg.l.next_multiple_of(W8_KEYS) * d)
                    .sum();
                if vt > a8.vt8.len() {
                    return Err(DevError("FP8 attention: Vᵀ buffer too small".into()));
                }
            }
            let mut vt_off = 0;
            for (si, sg) in p.segs.iter().enumerate() {
                let call = AttnCall {
                    q: match q_rows {
                        Some(_) => w.qkv.ptr(),
                        None => w.q.at(sg.j * d * self.k.attn.q_bytes()),
                    },
                    k: w.kc.at(sg.j * d * 2),
                    v: if ws_rows {
                        w.qkv.at((sg.img_row0 * 3 * d + 2 * d) * 2)
                    } else {
                        w.vc.at(sg.j * d * 2)
                    },
                    v_ld: ws_rows.then_some(3 * d),
                    len: sg.l,
                    n_heads: nh,
                    scale,
                    img_row0: sg.img_row0,
                    np: sg.np,
                    cap_row0: sg.cap_row0,
                    out: w.hb.ptr(),
                    force_split: false,
                    q_rows,
                };
                match attn8 {
                    Some((k8, a8)) => {
                        let lp = sg.l.next_multiple_of(W8_KEYS);
                        let e = Attn8Call {
                            q8: a8.q8.at(sg.j * d),
                            qsc: a8.qsc.at(sg.j * nh * 4),
                            k8: a8.k8.at(sg.j * d),
                            k_scale: b.k8_scale,
                            k_from_f16: false,
                            vt8: a8.vt8.at(vt_off),
                            lp,
                            amax: a8.amax.at(si * nh * 4),
                            out_e4m3: o_e4m3,
                            // V straight from the GEMM's rows: qk_norm_rope made no f16 copy.
                            v_rows: Some((w.qkv.at(2 * d * 2), 3 * d)),
                        };
                        vt_off += lp * d;
                        k8.launch(&self.dev, &call, &e)?;
                    }
                    None => self.k.attn.launch(&self.dev, &call)?,
                }
            }
            self.prof_stop(t, ATTN)?;
            let t = self.prof_start()?;
            if o_e4m3.is_none() {
                self.quantize_attention(w, &b.out, d, r)?;
            }
            let attn_o = self.block_gemm(w, &b.out, (d, d), r, w.o.ptr(), true)?;
            self.prof_stop(t, GEMM)?;
            let t = self.prof_start()?;
            let ffn_norm = NextNorm {
                w: norm_w(m, &b.f1),
                modulation: m,
                slot: 2,
                out: w.gemm_input(&b.w13),
            };
            residual(attn_o, &b.n2, 1, Some(ffn_norm))?;
            self.prof_stop(t, ROWS)?;
            let t = self.prof_start()?;
            let gu = self.block_gemm(w, &b.w13, (2 * f, d), r, w.g.ptr(), true)?;
            self.prof_stop(t, GEMM)?;
            let t = self.prof_start()?;
            let out = w.gemm_input(&b.w2);
            dit_rows::swiglu(&self.dev, &self.k.rows, gu, r, f, out)?;
            self.prof_stop(t, ROWS)?;
            let t = self.prof_start()?;
            let ffn_o = self.block_gemm(w, &b.w2, (d, f), r, w.o.ptr(), true)?;
            self.prof_stop(t, GEMM)?;
            let t = self.prof_start()?;
            let next = blocks.get(i + 1).map(|nb| NextNorm {
                w: norm_w(mods[i + 1], &nb.n1),
                modulation: mods[i + 1],
                slot: 0,
                out: w.gemm_input(&nb.qkv),
            });
            residual(ffn_o, &b.f2, 3, next)?;
            self.prof_stop(t, ROWS)?;
        }
        Ok(())
    }

    /// Before the O GEMM, where the attention wrote its output as bf16 rows in `hb`: when the
    /// GEMM on `w` runs in 8 bits they are quantised here (the attention kernels write per head
    /// and a row's amax spans all heads; the FP8 attention writes e4m3 itself, with a scale its
    /// V maxima bound, where the O GEMM runs in FP8).
    pub(super) fn quantize_attention(
        &self,
        work: &Work,
        w: &Plane,
        k: usize,
        r: usize,
    ) -> DResult<()> {
        match (work.q8_input(w), &self.gemm8) {
            (Some((q, s)), Some(g)) => g.quantize(work.hb.ptr(), r, k, k, q, s),
            _ => Ok(()),
        }
    }

    pub(super) fn condition_dev(
        &mut self,
        cap: &[f32],
        len: usize,
        rope: RopeRows,
    ) -> DResult<CondId> {
        let g = self.geo.clone();
        let (d, cf) = (g.dim, g.cap_feat_dim);
        let lp = pad_rows(len.max(1));
        let dev = self.dev.clone();
        let work = self.new_work(lp)?;
        let capd = dev.upload_new(bytes_of(cap))?;
        let rows = dev.alloc(lp * d * self.x_bytes)?;
        self.launch(
            &self.k.rms,
            (len as u32, 1, 1),
            ROW_THREADS,
            0,
            &[
                Arg::Ptr(capd.ptr()),
                Arg::Ptr(self.cap_norm.ptr()),
                Arg::F32(g.norm_eps),
                Arg::I32(cf as i32),
                Arg::Ptr(work.hb.ptr()),
            ],
        )?;
        self.gemm(&self.cap_embed.0, d, cf, work.hb.ptr(), work.q.ptr(), len)?;
        self.launch(
            &self.k.bias_pad,
            row_grid(lp),
            256,
            0,
            &[
                Arg::Ptr(work.q.ptr()),
                Arg::Ptr(rows.ptr()),
                Arg::I32(d as i32),
                Arg::U64(lp as u64),
                Arg::I32(lp as i32),
                Arg::I32(len as i32),
                Arg::Ptr(self.cap_embed.1.ptr()),
                Arg::Ptr(self.cap_pad.ptr()),
            ],
        )?;
        let map: Vec<i32> = (0..lp)
            .flat_map(|j| [0, 0, lp as i32, j as i32, j as i32])
            .collect();
        let mapd = dev.upload_new(bytes_of(&map))?;
        let cos = dev.upload_new(bytes_of(rope.cos))?;
        let sin = dev.upload_new(bytes_of(rope.sin))?;
        if !self.ctx.is_empty() {
            let segs = [Seg {
                j: 0,
                l: lp,
                img_row0: 0,
                np: lp,
                cap_row0: 0,
            }];
            let pass = Pass {
                x: rows.ptr(),
                rows: lp,
                map: mapd.ptr(),
                cos: cos.ptr(),
                sin: sin.ptr(),
                segs: &segs,
            };
            let mods = vec![0u64; self.ctx.len()];
            self.run_blocks(&self.ctx, &mods, 0, &pass, &work)?;
        }
        dev.sync()?;
        let id = CondId(self.conds.len());
        self.conds.push(Some(Cond { rows, lp }));
        Ok(id)
    }

    pub(super) fn prepare_dev(&mut self, items: &[DitItemSetup], ni: usize) -> DResult<()> {
        self.keep_work();
        let g = self.geo.clone();
        let (d, a, pd) = (g.dim, g.adaln_dim, g.patch_dim);
        let half = g.head_dim() / 2;
        let np = pad_rows(ni);
        let nb = items.len();
        let mut rope_rows = 0;
        let mut its = Vec::with_capacity(nb);
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for it in items {
            let lp = self.conds[it.cond.0].as_ref().expect("checked").lp;
            its.push((it.cond, lp, rope_rows));
            rope_rows += np + lp;
            cos.extend_from_slice(it.rope.cos);
            sin.extend_from_slice(it.rope.sin);
        }
        debug_assert_eq!(cos.len(), rope_rows * half);
        let rows: usize = its.iter().map(|&(_, lp, _)| np + lp).sum();
        let n_mod = self.noise.len() + self.layers.len();
        let dev = self.dev.clone();
        let prep = Prepared {
            ni,
            np,
            items: its,
            cos: dev.upload_new(bytes_of(&cos))?,
            sin: dev.upload_new(bytes_of(&sin))?,
            x: dev.alloc(rows * d * self.x_bytes)?,
            work: match self.spare_work.take() {
                Some(w) if w.rows == rows => w,
                _ => self.new_work(rows)?,
            },
            map_main: dev.alloc(rows * MAPW * 4)?,
            map_nr: dev.alloc(nb * np * MAPW * 4)?,
            patches: dev.alloc(nb * ni * pd * 2)?,
            temb: dev.alloc(nb * a * 2)?,
            temb_silu: dev.alloc(nb * a * 2)?,
            modv: dev.alloc(nb * n_mod * 4 * d * 4)?,
            fscale: dev.alloc(nb * d * 4)?,
            out: dev.alloc(nb * ni * pd * 4)?,
            out_host: PinnedBuf::new(nb * ni * pd * 4).ok(),
            maps_for: Vec::new(),
            graph: None,
        };
        dev.sync()?;
        self.prep = Some(prep);
        Ok(())
    }

    pub(super) fn step_dev(&mut self, items: &[DitStepItem], out: &mut Vec<f32>) -> DResult<()> {
        let g = self.geo.clone();
        let (a, pd) = (g.adaln_dim, g.patch_dim);
        let p = self.prep.as_ref().expect("checked");
        let (ni, np, nb) = (p.ni, p.np, items.len());
        let active: Vec<usize> = items.iter().map(|it| it.slot).collect();
        let lay = layout_rows(np, &p.items, &active);
        let dev = self.dev.clone();
        if p.maps_for != active {
            dev.upload(p.map_main.ptr(), bytes_of(&lay.main))?;
            dev.upload(p.map_nr.ptr(), bytes_of(&lay.nr))?;
        }
        // Where a step's wall time goes, at debug verbosity: host conversions, uploads, the
        // device's own time (events around the launch) and the readback.
        let timing = crate::facade::log::debug_enabled();
        let w0 = std::time::Instant::now();
        // Host inputs: patches and t-embeddings as bf16 GEMM operands.
        let to_bf16 = |v: &mut Vec<u16>, xs: &[f32]| {
            v.extend(xs.iter().map(|&x| bf16::from_f32(x).to_bits()))
        };
        let mut pb = Vec::with_capacity(nb * ni * pd);
        let mut tb = Vec::with_capacity(nb * a);
        let mut sb = Vec::with_capacity(nb * a);
        for it in items {
            to_bf16(&mut pb, it.patches);
            to_bf16(&mut tb, it.t_emb);
            let silu: Vec<f32> = it.t_emb.iter().map(|&x| x / (1.0 + (-x).exp())).collect();
            to_bf16(&mut sb, &silu);
        }
        let convert_s = w0.elapsed().as_secs_f64();
        dev.upload(p.patches.ptr(), bytes_of(&pb))?;
        dev.upload(p.temb.ptr(), bytes_of(&tb))?;
        dev.upload(p.temb_silu.ptr(), bytes_of(&sb))?;
        let upload_s = w0.elapsed().as_secs_f64() - convert_s;

        // The device work: replayed as a graph captured for this set of active items. The first
        // step with a set runs eagerly (which also sets up what capture may not: cuBLAS's and
        // cuBLASLt's state, the FP8 plans) and the graph is captured right after it is enqueued,
        // while the GPU runs it, so the capture costs no device time. Eager when profiling, with
        // after a capture failed.
        let graphs = self.prof.is_none() && !self.no_graph;
        let p = self.prep.as_ref().expect("checked");
        let timer = if timing { Some(Timer::new()?) } else { None };
        if let Some(t) = &timer {
            t.start(&dev)?;
        }
        let l0 = std::time::Instant::now();
        let replay = matches!(&p.graph, Some((a, _)) if graphs && *a == active);
        match &p.graph {
            Some((_, gr)) if replay => gr.launch()?,
            _ => self.enqueue_step(p, &lay, &active)?,
        }
        let launch_s = l0.elapsed().as_secs_f64();
        if let Some(t) = &timer {
            t.stop(&dev)?;
        }
        let c0 = std::time::Instant::now();
        if graphs && !replay {
            match dev.capture(|| self.enqueue_step(p, &lay, &active)) {
                Ok(gr) => {
                    crate::facade::log::debug(&format!(
                        "dit: step graph captured for {} item(s) in {:.2} ms, beside the eager step",
                        active.len(),
                        1e3 * c0.elapsed().as_secs_f64()
                    ));
                    self.prep.as_mut().expect("checked").graph = Some((active.clone(), gr));
                }
                Err(e) => {
                    let why = format!(
                        "dit: the step graph's capture failed, eager from here: {}",
                        e.0
                    );
                    crate::facade::log::debug(&why);
                    self.no_graph = true;
                }
            }
        }
        let gpu_ms = match &timer {
            Some(t) => t.elapsed_ms()?,
            None => 0.0,
        };
        let r0 = std::time::Instant::now();
        out.resize(nb * ni * pd, 0.0);
        let p = self.prep.as_mut().expect("checked");
        match &mut p.out_host {
            Some(host) => {
                let bytes = &mut host.bytes_mut()[..4 * out.len()];
                dev.download(bytes, p.out.ptr())?;
                f32s_from_le_bytes(out, bytes);
            }
            None => dev.download_f32(out, p.out.ptr())?,
        }
        if timing {
            crate::facade::log::debug(&format!(
                "dit device step ({}): convert {:.2} ms, upload {:.2} ms, launch {:.2} ms, device {:.2} ms, readback {:.2} ms",
                if replay { "graph" } else { "eager" },
                1e3 * convert_s,
                1e3 * upload_s,
                1e3 * launch_s,
                gpu_ms,
                1e3 * r0.elapsed().as_secs_f64()
            ));
        }
        self.prep.as_mut().expect("checked").maps_for = active;
        Ok(())
    }

    /// Every launch of one step for the active items `active` (laid out as `lay`), in order:
    /// what the step graph captures. Reads the step's inputs where `step_dev` uploaded them and
    /// leaves the output in `p.out`.
    pub(super) fn enqueue_step(&self, p: &Prepared, lay: &Layout, active: &[usize]) -> DResult<()> {
        let g = &self.geo;
        let (d, a, pd) = (g.dim, g.adaln_dim, g.patch_dim);
        let (ni, np, nb) = (p.ni, p.np, active.len());
        let dev = &self.dev;
        // Modulations of every block (one GEMM, then 1 + scale and tanh(gate) once for all the
        // row kernels) and the final layer's scale.
        let n_mod = self.noise.len() + self.layers.len();
        let mod_stride = n_mod * 4 * d;
        self.gemm(&self.ada.0, mod_stride, a, p.temb.ptr(), p.modv.ptr(), nb)?;
        self.launch(
            &self.k.ada_finish,
            column_grid(mod_stride, nb),
            256,
            0,
            &[
                Arg::Ptr(p.modv.ptr()),
                Arg::I32(mod_stride as i32),
                Arg::U64(nb as u64),
                Arg::I32(d as i32),
                Arg::Ptr(self.ada.1.ptr()),
                Arg::Ptr(self.ada_norms.ptr()),
            ],
        )?;
        self.gemm(
            &self.final_ada.0,
            d,
            a,
            p.temb_silu.ptr(),
            p.fscale.ptr(),
            nb,
        )?;
        self.add_bias(p.fscale.ptr(), d, nb, &self.final_ada.1)?;

        // Embed the patches of each item into its Np image rows (f32, in the work's Q buffer),
        // then into X with the bias; pad rows take x_pad_token.
        for k in 0..nb {
            self.gemm(
                &self.x_embed.0,
                d,
                pd,
                p.patches.at(k * ni * pd * 2),
                p.work.q.at(k * np * d * 4),
                ni,
            )?;
        }
        self.launch(
            &self.k.bias_pad,
            row_grid(nb * np),
            256,
            0,
            &[
                Arg::Ptr(p.work.q.ptr()),
                Arg::Ptr(p.x.ptr()),
                Arg::I32(d as i32),
                Arg::U64((nb * np) as u64),
                Arg::I32(np as i32),
                Arg::I32(ni as i32),
                Arg::Ptr(self.x_embed.1.ptr()),
                Arg::Ptr(self.x_pad.ptr()),
            ],
        )?;
        let mod_at = |b: usize| p.modv.at(b * 4 * d * 4);
        if !self.noise.is_empty() {
            let mods: Vec<u64> = (0..self.noise.len()).map(mod_at).collect();
            let pass = Pass {
                x: p.x.ptr(),
                rows: nb * np,
                map: p.map_nr.ptr(),
                cos: p.cos.ptr(),
                sin: p.sin.ptr(),
                segs: &lay.segs_nr,
            };
            self.run_blocks(&self.noise, &mods, mod_stride, &pass, &p.work)?;
        }
        for (k, &s) in active.iter().enumerate() {
            let (cond, lp, _) = p.items[s];
            let c = self.conds[cond.0].as_ref().expect("checked");
            let xb = self.x_bytes;
            dev.copy_d2d(p.x.at(lay.cap_rows[k] * d * xb), c.rows.ptr(), lp * d * xb)?;
        }
        if !self.layers.is_empty() {
            let mods: Vec<u64> = (0..self.layers.len())
                .map(|l| mod_at(self.noise.len() + l))
                .collect();
            let pass = Pass {
                x: p.x.ptr(),
                rows: lay.rows,
                map: p.map_main.ptr(),
                cos: p.cos.ptr(),
                sin: p.sin.ptr(),
                segs: &lay.segs_main,
            };
            self.run_blocks(&self.layers, &mods, mod_stride, &pass, &p.work)?;
        }
        // Final layer on the real image rows.
        self.launch(
            &self.k.final_norm,
            ((nb * ni) as u32, 1, 1),
            ROW_THREADS,
            0,
            &[
                Arg::Ptr(p.x.ptr()),
                Arg::I32(d as i32),
                Arg::F32(g.final_eps),
                Arg::I32(np as i32),
                Arg::I32(ni as i32),
                Arg::Ptr(p.fscale.ptr()),
                Arg::Ptr(p.work.hb.ptr()),
            ],
        )?;
        self.gemm(
            &self.final_lin.0,
            pd,
            d,
            p.work.hb.ptr(),
            p.out.ptr(),
            nb * ni,
        )?;
        self.add_bias(p.out.ptr(), pd, nb * ni, &self.final_lin.1)
    }
}
