//! Tensor maps for the Hopper TMA unit (`cp.async.bulk.tensor`): made on the host, passed to a
//! kernel by value (`__grid_constant__`), read by the copy engine.

use super::device::{DResult, DevError};
use cudarc::driver::sys;

/// The 128 bytes of a `CUtensorMap`, ready to pass as a kernel argument.
pub type TensorMap = [u8; 128];

/// Element types the maps here describe.
#[derive(Clone, Copy, Debug)]
pub enum TmaElem {
    F16,
    /// Raw bytes (e4m3).
    U8,
}

impl TmaElem {
    fn bytes(self) -> u32 {
        match self {
            TmaElem::F16 => 2,
            TmaElem::U8 => 1,
        }
    }
    fn data_type(self) -> sys::CUtensorMapDataType {
        match self {
            TmaElem::F16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            TmaElem::U8 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
        }
    }
}

/// A 3-D f16 tensor (see [`swizzled_3d`]).
pub fn f16_3d_swizzled(
    base: u64,
    dims: [u64; 3],
    strides: [u64; 2],
    boxes: [u32; 3],
) -> DResult<TensorMap> {
    swizzled_3d(TmaElem::F16, base, dims, strides, boxes)
}

/// A 3-D tensor `[d2][d1][d0]` of `elem` at device address `base` (`d0` contiguous; `strides`
/// are the byte strides of d1 and d2), copied in boxes of `boxes` elements with the 128-byte
/// swizzle (the layout wgmma reads at full rate; `boxes[0]` elements must span 128 bytes).
/// Elements past a dimension read as zeros.
pub fn swizzled_3d(
    elem: TmaElem,
    base: u64,
    dims: [u64; 3],
    strides: [u64; 2],
    boxes: [u32; 3],
) -> DResult<TensorMap> {
    if base % 16 != 0 || strides.iter().any(|s| s % 16 != 0) || boxes[0] * elem.bytes() != 128 {
        return Err(DevError(format!(
            "tensor map: base {base:#x}, strides {strides:?} must be 16-byte aligned and the inner box 128 bytes ({} given)",
            boxes[0] * elem.bytes()
        )));
    }
    let mut map: sys::CUtensorMap = unsafe { std::mem::zeroed() };
    let elem_strides = [1u32; 3];
    // SAFETY: every pointer is to a live local array of the rank's length; the map is
    // written by the driver and only read back as bytes.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            elem.data_type(),
            3,
            base as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(DevError(format!(
            "cuTensorMapEncodeTiled {r:?} (dims {dims:?}, strides {strides:?}, box {boxes:?})"
        )));
    }
    // SAFETY: CUtensorMap is 16 u64 words, plain data.
    Ok(unsafe { std::mem::transmute::<sys::CUtensorMap, TensorMap>(map) })
}
