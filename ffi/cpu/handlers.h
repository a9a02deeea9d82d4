// The CPU FFI handler symbols, registered by ffi/module.cc.
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(Nvfp4AmaxCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Nvfp4QuantizeCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Nvfp4DequantizeCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Nvfp4GroupedAmaxCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Nvfp4GroupedQuantizeCpu);
