//! cmf-zimage
