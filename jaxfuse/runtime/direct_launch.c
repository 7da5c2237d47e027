/* jaxfuse's XLA FFI handler: launches one compiled Triton kernel.
 *
 * Why: jaxlib's Triton custom call looks its kernel up by hashing the
 * serialized call and re-checks module and context caches under locks on
 * every execution; on an H100 host that made a fused call cost 4.3 us of
 * host time against 0.7 us per kernel XLA launches itself (benchmarks/
 * RESULTS.md, eighth session). Here every attribute is decoded by XLA once,
 * the kernel is found by a 64-bit id in a small table, and an execution is
 * one cuLaunchKernel.
 *
 * Plain C against XLA's FFI C API (jax.ffi.include_dir()); the CUDA driver
 * is opened with dlopen, so building needs no CUDA headers or toolkit.
 *
 * Attributes (jaxfuse/runtime/direct_launch.py writes them):
 *   kid    i64   id of (image, name, shared memory); the table key
 *   image  str   cubin, base64 ("image_kind" 1) or PTX text (0)
 *   image_kind i64
 *   name   str   kernel symbol
 *   grid   i64[3], block i64 (threads), smem i64 (bytes of shared memory)
 *   kinds  i64[n] per kernel parameter: 0 buffer (the next operand, then
 *                 result), 1 i32, 2 u32, 3 i64, 4 u64, 5 f32, 6 f64, 7 bool
 *   values i64[n] a scalar's bits; for a buffer, bytes to zero first
 *   uses_pdl pred  optional; true for a kernel that waits on its grid
 *                dependency (griddepcontrol.wait) before it touches memory.
 *                XLA reads it too: with it, its command buffers may start
 *                the kernel while the previous kernel finishes.
 *   scratch i64  optional; the index of a buffer (operands, then results)
 *                passed as the kernel's global scratch instead of as a
 *                parameter (kernels that make TMA descriptors on the device
 *                write them there). Absent or -1: null.
 * Triton kernels take two hidden pointers after their parameters (global
 * and profile scratch); the profile scratch is always null.
 *
 * Built with JAXFUSE_RECORD (against a jaxlib whose FFI has the record
 * extension), jaxfuse_direct_record is the handler's record stage: inside
 * XLA's command buffers the launch becomes a kernel node that XLA creates
 * and updates itself, instead of a stream capture of this launch per
 * call. Calls that zero a buffer first ask for the stream capture.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "xla/ffi/api/c_api.h"
#ifdef JAXFUSE_RECORD
#include "xla/ffi/api/record_c_api.h"
#endif

typedef int CUresult;
typedef int CUdevice;
typedef void* CUcontext;
typedef void* CUmodule;
typedef void* CUfunction;
typedef void* CUstream;
typedef unsigned long long CUdeviceptr;

enum {
  kFuncAttrSharedSizeBytes = 1,          /* CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES */
  kFuncAttrMaxDynamicShared = 8,         /* CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES */
  kDevAttrMaxSharedPerBlockOptin = 97,   /* CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN */
  kCaptureStatusActive = 1,              /* CU_STREAM_CAPTURE_STATUS_ACTIVE */
  kStaticSharedLimit = 49152,
  kMaxParams = 128,
  kInitialTableSize = 256,
};

static struct {
  CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                           unsigned, unsigned, CUstream, void**, void**);
  CUresult (*ModuleLoadData)(CUmodule*, const void*);
  CUresult (*ModuleGetFunction)(CUfunction*, CUmodule, const char*);
  CUresult (*StreamGetCtx)(CUstream, CUcontext*);
  CUresult (*StreamIsCapturing)(CUstream, int*);
  CUresult (*CtxGetCurrent)(CUcontext*);
  CUresult (*CtxPushCurrent)(CUcontext);
  CUresult (*CtxPopCurrent)(CUcontext*);
  CUresult (*CtxGetDevice)(CUdevice*);
  CUresult (*DeviceGetAttribute)(int*, int, CUdevice);
  CUresult (*FuncGetAttribute)(int*, int, CUfunction);
  CUresult (*FuncSetAttribute)(CUfunction, int, int);
  CUresult (*MemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream);
  CUresult (*GetErrorString)(CUresult, const char**);
} cu;
static pthread_once_t g_driver_once = PTHREAD_ONCE_INIT;
static const char* g_driver_error;   /* NULL once the driver is open */

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;

/* A loaded kernel (fn, keyed by kid and context) or, for XLA's record
 * stage, a kernel image (data, keyed by kid and a NULL context): XLA loads
 * the image itself and keys it by its address, so it is kept for the life
 * of the process. */
typedef struct {
  int64_t kid;
  CUcontext ctx;
  CUfunction fn;
  unsigned char* data;
  size_t size;
} Entry;
/* Open addressing on (kid, ctx); grows at 3/4 full. Kernels stay loaded for
 * the life of the process, as in jaxlib. */
static Entry* g_table;
static size_t g_capacity, g_entries;

static int occupied(const Entry* e) { return e->fn != NULL || e->data != NULL; }

static size_t slot_of(int64_t kid, CUcontext ctx, size_t capacity) {
  return (size_t)((((uint64_t)kid ^ (uint64_t)(uintptr_t)ctx) * 0x9E3779B97F4A7C15ull) >> 32) &
         (capacity - 1);
}

/* 0 on success. Called with g_lock held. */
static int grow_table(void) {
  size_t capacity = g_capacity ? 2 * g_capacity : kInitialTableSize;
  Entry* table = (Entry*)calloc(capacity, sizeof(Entry));
  if (!table) return 1;
  for (size_t i = 0; i < g_capacity; ++i) {
    if (!occupied(&g_table[i])) continue;
    size_t j = slot_of(g_table[i].kid, g_table[i].ctx, capacity);
    while (occupied(&table[j])) j = (j + 1) & (capacity - 1);
    table[j] = g_table[i];
  }
  free(g_table);
  g_table = table;
  g_capacity = capacity;
  return 0;
}

static XLA_FFI_Error* make_error(const XLA_FFI_Api* api, XLA_FFI_Error_Code code,
                                 const char* msg) {
  XLA_FFI_Error_Create_Args a;
  memset(&a, 0, sizeof(a));
  a.struct_size = XLA_FFI_Error_Create_Args_STRUCT_SIZE;
  a.message = msg;
  a.errc = code;
  return api->XLA_FFI_Error_Create(&a);
}

static XLA_FFI_Error* cu_error(const XLA_FFI_Api* api, const char* what, CUresult r) {
  char msg[256];
  const char* s = NULL;
  if (cu.GetErrorString) cu.GetErrorString(r, &s);
  snprintf(msg, sizeof(msg), "jaxfuse direct launch: %s failed: %s (CUresult %d)", what,
           s ? s : "unknown error", r);
  return make_error(api, XLA_FFI_Error_Code_INTERNAL, msg);
}

#define LOAD(field, sym)                                 \
  do {                                                   \
    *(void**)(&cu.field) = dlsym(lib, sym);              \
    if (!cu.field) return "missing driver symbol " sym;  \
  } while (0)

/* Opens the CUDA driver; NULL on success, else what went wrong. */
static const char* open_driver(void) {
  /* JAXFUSE_CUDA_DRIVER names another driver library (tests use a fake). */
  const char* path = getenv("JAXFUSE_CUDA_DRIVER");
  void* lib = dlopen(path && *path ? path : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib && !(path && *path)) lib = dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
  if (!lib) return "cannot open the CUDA driver (libcuda.so.1)";
  LOAD(LaunchKernel, "cuLaunchKernel");
  LOAD(ModuleLoadData, "cuModuleLoadData");
  LOAD(ModuleGetFunction, "cuModuleGetFunction");
  LOAD(StreamGetCtx, "cuStreamGetCtx");
  LOAD(StreamIsCapturing, "cuStreamIsCapturing");
  LOAD(CtxGetCurrent, "cuCtxGetCurrent");
  LOAD(CtxPushCurrent, "cuCtxPushCurrent_v2");
  LOAD(CtxPopCurrent, "cuCtxPopCurrent_v2");
  LOAD(CtxGetDevice, "cuCtxGetDevice");
  LOAD(DeviceGetAttribute, "cuDeviceGetAttribute");
  LOAD(FuncGetAttribute, "cuFuncGetAttribute");
  LOAD(FuncSetAttribute, "cuFuncSetAttribute");
  LOAD(MemsetD8Async, "cuMemsetD8Async");
  LOAD(GetErrorString, "cuGetErrorString");
  return NULL;
}

static void open_driver_once(void) { g_driver_error = open_driver(); }

/* ------------------------------------------------------------ attributes */

typedef struct {
  int64_t kid, image_kind, block, smem, uses_pdl, scratch;
  const int64_t* grid;
  const int64_t* kinds;
  const int64_t* values;
  int64_t n_grid, n_kinds, n_values;
  XLA_FFI_ByteSpan image, name;
  int seen;
} Attrs;

static int name_is(const XLA_FFI_ByteSpan* n, const char* s) {
  size_t len = strlen(s);
  return n->len == len && memcmp(n->ptr, s, len) == 0;
}

/* 0 on success; otherwise writes a message into err. */
static int decode_attrs(const XLA_FFI_Attrs* attrs, Attrs* out, char* err, size_t err_len) {
  memset(out, 0, sizeof(*out));
  out->scratch = -1;
  for (int64_t i = 0; i < attrs->size; ++i) {
    const XLA_FFI_ByteSpan* n = attrs->names[i];
    XLA_FFI_AttrType t = attrs->types[i];
    if (t == XLA_FFI_AttrType_SCALAR) {
      const XLA_FFI_Scalar* s = (const XLA_FFI_Scalar*)attrs->attrs[i];
      if (name_is(n, "uses_pdl") && s->dtype == XLA_FFI_DataType_PRED) {
        out->uses_pdl = *(const uint8_t*)s->value != 0;
        continue;
      }
      if (s->dtype != XLA_FFI_DataType_S64) {
        snprintf(err, err_len, "attribute %.*s must be a 64-bit integer", (int)n->len, n->ptr);
        return 1;
      }
      int64_t v = *(const int64_t*)s->value;
      if (name_is(n, "kid")) { out->kid = v; out->seen |= 1; }
      else if (name_is(n, "image_kind")) { out->image_kind = v; out->seen |= 2; }
      else if (name_is(n, "block")) { out->block = v; out->seen |= 4; }
      else if (name_is(n, "smem")) { out->smem = v; out->seen |= 8; }
      else if (name_is(n, "scratch")) out->scratch = v;
    } else if (t == XLA_FFI_AttrType_ARRAY) {
      const XLA_FFI_Array* a = (const XLA_FFI_Array*)attrs->attrs[i];
      if (a->dtype != XLA_FFI_DataType_S64) {
        snprintf(err, err_len, "attribute %.*s must be an array of 64-bit integers",
                 (int)n->len, n->ptr);
        return 1;
      }
      if (name_is(n, "grid")) { out->grid = a->data; out->n_grid = a->size; out->seen |= 16; }
      else if (name_is(n, "kinds")) { out->kinds = a->data; out->n_kinds = a->size; out->seen |= 32; }
      else if (name_is(n, "values")) { out->values = a->data; out->n_values = a->size; out->seen |= 64; }
    } else if (t == XLA_FFI_AttrType_STRING) {
      const XLA_FFI_ByteSpan* s = (const XLA_FFI_ByteSpan*)attrs->attrs[i];
      if (name_is(n, "image")) { out->image = *s; out->seen |= 128; }
      else if (name_is(n, "name")) { out->name = *s; out->seen |= 256; }
    }
  }
  if (out->seen != 511) {
    snprintf(err, err_len, "missing attributes (have mask %d of 511)", out->seen);
    return 1;
  }
  if (out->n_grid != 3 || out->n_kinds != out->n_values || out->n_kinds > kMaxParams) {
    snprintf(err, err_len, "bad grid (%lld) or parameter lists (%lld kinds, %lld values)",
             (long long)out->n_grid, (long long)out->n_kinds, (long long)out->n_values);
    return 1;
  }
  return 0;
}

/* ------------------------------------------------------------ kernels */

static int b64_value(unsigned char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

/* Decoded bytes (malloc'd; caller frees) or NULL on malformed input. */
static unsigned char* b64_decode(const char* s, size_t len, size_t* out_len) {
  unsigned char* out = (unsigned char*)malloc(len / 4 * 3 + 4);
  size_t o = 0;
  unsigned acc = 0;
  int bits = 0;
  if (!out) return NULL;
  for (size_t i = 0; i < len; ++i) {
    if (s[i] == '=') break;
    int v = b64_value((unsigned char)s[i]);
    if (v < 0) { free(out); return NULL; }
    acc = (acc << 6) | (unsigned)v;
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out[o++] = (unsigned char)((acc >> bits) & 0xFF);
    }
  }
  *out_len = o;
  return out;
}

/* The kernel's name, NUL-terminated, into name[256]; 0 on success. */
static int kernel_name(const Attrs* at, char* name) {
  if (at->name.len >= 256) return 1;
  memcpy(name, at->name.ptr, at->name.len);
  name[at->name.len] = 0;
  return 0;
}

/* The kernel image as the driver takes it (malloc'd; the caller frees):
 * the decoded cubin, or the PTX NUL-terminated. NULL with *err set. */
static unsigned char* image_bytes(const XLA_FFI_Api* api, const Attrs* at, size_t* size,
                                  XLA_FFI_Error** err) {
  unsigned char* out;
  if (at->image_kind == 1) {
    out = b64_decode(at->image.ptr, at->image.len, size);
    if (!out)
      *err = make_error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT, "malformed cubin attribute");
    return out;
  }
  out = (unsigned char*)malloc(at->image.len + 1);
  if (!out) {
    *err = make_error(api, XLA_FFI_Error_Code_RESOURCE_EXHAUSTED, "out of memory");
    return NULL;
  }
  memcpy(out, at->image.ptr, at->image.len);
  out[at->image.len] = 0;
  *size = at->image.len + 1;
  return out;
}

/* Loads the kernel into ctx (first use only). Called with g_lock held. */
static XLA_FFI_Error* load_kernel(const XLA_FFI_Api* api, const Attrs* at, CUcontext ctx,
                                  CUfunction* fn) {
  char name[256];
  CUmodule mod;
  CUresult r;
  size_t size;
  XLA_FFI_Error* err = NULL;
  if (kernel_name(at, name))
    return make_error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT, "kernel name too long");
  unsigned char* image = image_bytes(api, at, &size, &err);
  if (!image) return err;
  if ((r = cu.CtxPushCurrent(ctx)) != 0) { free(image); return cu_error(api, "cuCtxPushCurrent", r); }
  r = cu.ModuleLoadData(&mod, image);
  free(image);
  if (r != 0) err = cu_error(api, "cuModuleLoadData", r);
  if (!err && (r = cu.ModuleGetFunction(fn, mod, name)) != 0)
    err = cu_error(api, "cuModuleGetFunction", r);
  if (!err && at->smem > kStaticSharedLimit) {
    /* Over 48 KiB of shared memory must be opted into per function. */
    CUdevice dev;
    int optin = 0, fixed = 0;
    if ((r = cu.CtxGetDevice(&dev)) != 0) err = cu_error(api, "cuCtxGetDevice", r);
    else if ((r = cu.DeviceGetAttribute(&optin, kDevAttrMaxSharedPerBlockOptin, dev)) != 0)
      err = cu_error(api, "cuDeviceGetAttribute", r);
    else if (at->smem > optin)
      err = make_error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                       "kernel needs more shared memory than the device has");
    else if ((r = cu.FuncGetAttribute(&fixed, kFuncAttrSharedSizeBytes, *fn)) != 0)
      err = cu_error(api, "cuFuncGetAttribute", r);
    else if ((r = cu.FuncSetAttribute(*fn, kFuncAttrMaxDynamicShared, optin - fixed)) != 0)
      err = cu_error(api, "cuFuncSetAttribute", r);
  }
  CUcontext popped;
  cu.CtxPopCurrent(&popped);
  return err;
}

/* The table's entry for (kid, ctx), empty if there is none yet; NULL when
 * the table cannot grow. Called with g_lock held. */
static Entry* entry_for(int64_t kid, CUcontext ctx) {
  if ((g_entries + 1) * 4 > g_capacity * 3 && grow_table()) return NULL;
  size_t i = slot_of(kid, ctx, g_capacity);
  while (occupied(&g_table[i]) && !(g_table[i].kid == kid && g_table[i].ctx == ctx))
    i = (i + 1) & (g_capacity - 1);
  return &g_table[i];
}

static XLA_FFI_Error* table_full(const XLA_FFI_Api* api) {
  return make_error(api, XLA_FFI_Error_Code_RESOURCE_EXHAUSTED,
                    "jaxfuse direct launch: out of memory for the kernel table");
}

static XLA_FFI_Error* find_kernel(const XLA_FFI_Api* api, const Attrs* at, CUcontext ctx,
                                  CUfunction* fn) {
  XLA_FFI_Error* err = NULL;
  pthread_mutex_lock(&g_lock);
  Entry* e = entry_for(at->kid, ctx);
  if (!e) {
    err = table_full(api);
  } else if (e->fn) {
    *fn = e->fn;
  } else if (!(err = load_kernel(api, at, ctx, fn))) {
    e->kid = at->kid;
    e->ctx = ctx;
    e->fn = *fn;
    ++g_entries;
  }
  pthread_mutex_unlock(&g_lock);
  return err;
}

/* ------------------------------------------------------------ handler */

/* Handler traits XLA is told (registration and metadata query agree). */
static uint32_t g_traits = XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE;

void jaxfuse_direct_launch_set_traits(uint32_t traits) { g_traits = traits; }

static XLA_FFI_Error* answer_metadata(XLA_FFI_CallFrame* frame) {
  XLA_FFI_Metadata_Extension* ext = (XLA_FFI_Metadata_Extension*)frame->extension_start;
  XLA_FFI_Metadata* md = ext->metadata;
  md->api_version.major_version = XLA_FFI_API_MAJOR;
  md->api_version.minor_version = XLA_FFI_API_MINOR;
  md->traits = g_traits;
  return NULL;
}

/* Decodes the call's attributes into at; NULL on success. */
static XLA_FFI_Error* decode_call(const XLA_FFI_CallFrame* frame, Attrs* at) {
  char err[256];
  if (!decode_attrs(&frame->attrs, at, err, sizeof(err))) return NULL;
  char msg[300];
  snprintf(msg, sizeof(msg), "jaxfuse direct launch: %s", err);
  return make_error(frame->api, XLA_FFI_Error_Code_INVALID_ARGUMENT, msg);
}

static uint64_t buffer_address(const XLA_FFI_CallFrame* frame, int64_t b) {
  XLA_FFI_Buffer* buf = (XLA_FFI_Buffer*)(b < frame->args.size
                                              ? frame->args.args[b]
                                              : frame->rets.rets[b - frame->args.size]);
  return (uint64_t)(uintptr_t)buf->data;
}

/* The kernel's parameter values: a buffer's device address, a scalar's
 * bits; then the global scratch (the "scratch" buffer, or null) and the
 * null profile scratch. NULL on success. */
static XLA_FFI_Error* fill_slots(const XLA_FFI_CallFrame* frame, const Attrs* at,
                                 uint64_t* slots) {
  int64_t n_buffers = frame->args.size + frame->rets.size, b = 0;
  if (at->scratch >= n_buffers)
    return make_error(frame->api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                      "jaxfuse direct launch: scratch names no buffer");
  for (int64_t i = 0; i < at->n_kinds; ++i) {
    if (at->kinds[i] != 0) {
      slots[i] = (uint64_t)at->values[i];
      continue;
    }
    if (b == at->scratch) ++b;
    if (b >= n_buffers)
      return make_error(frame->api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                        "jaxfuse direct launch: more buffer parameters than buffers");
    slots[i] = buffer_address(frame, b++);
  }
  if (b == at->scratch) ++b;
  if (b != n_buffers)
    return make_error(frame->api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                      "jaxfuse direct launch: fewer buffer parameters than buffers");
  slots[at->n_kinds] = at->scratch >= 0 ? buffer_address(frame, at->scratch) : 0;
  slots[at->n_kinds + 1] = 0;
  return NULL;
}

static XLA_FFI_Error* instantiate(XLA_FFI_CallFrame* frame);

XLA_FFI_Error* jaxfuse_direct_launch(XLA_FFI_CallFrame* frame) {
  if (frame->extension_start && frame->extension_start->type == XLA_FFI_Extension_Metadata)
    return answer_metadata(frame);
  const XLA_FFI_Api* api = frame->api;
  if (frame->stage == XLA_FFI_ExecutionStage_INSTANTIATE) return instantiate(frame);
  if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return NULL;

  Attrs at;
  XLA_FFI_Error* e = decode_call(frame, &at);
  if (e) return e;
  /* The driver takes a pointer to each parameter's value. */
  void* params[kMaxParams + 2];
  uint64_t slots[kMaxParams + 2];
  if ((e = fill_slots(frame, &at, slots))) return e;
  for (int64_t i = 0; i < at.n_kinds + 2; ++i) params[i] = &slots[i];

  XLA_FFI_Stream_Get_Args sa;
  memset(&sa, 0, sizeof(sa));
  sa.struct_size = XLA_FFI_Stream_Get_Args_STRUCT_SIZE;
  sa.ctx = frame->ctx;
  if ((e = api->XLA_FFI_Stream_Get(&sa))) return e;
  CUstream stream = (CUstream)sa.stream;

  /* The driver's entry points are written once, by the first call. */
  pthread_once(&g_driver_once, open_driver_once);
  if (g_driver_error)
    return make_error(api, XLA_FFI_Error_Code_FAILED_PRECONDITION, g_driver_error);
  CUcontext ctx;
  int capturing = 0;
  CUresult r = cu.StreamIsCapturing(stream, &capturing);
  if (r != 0) return cu_error(api, "cuStreamIsCapturing", r);
  /* cuStreamGetCtx is not allowed while a stream is being captured. */
  r = capturing == kCaptureStatusActive ? cu.CtxGetCurrent(&ctx) : cu.StreamGetCtx(stream, &ctx);
  if (r != 0) return cu_error(api, "getting the stream's context", r);

  CUfunction fn;
  if ((e = find_kernel(api, &at, ctx, &fn))) return e;

  for (int64_t i = 0; i < at.n_kinds; ++i) {
    if (at.kinds[i] == 0 && at.values[i] > 0) {
      r = cu.MemsetD8Async((CUdeviceptr)slots[i], 0, (size_t)at.values[i], stream);
      if (r != 0) return cu_error(api, "cuMemsetD8Async", r);
    }
  }
  r = cu.LaunchKernel(fn, (unsigned)at.grid[0], (unsigned)at.grid[1], (unsigned)at.grid[2],
                      (unsigned)at.block, 1, 1, (unsigned)at.smem, stream, params, NULL);
  if (r != 0) return cu_error(api, "cuLaunchKernel", r);
  return NULL;
}

#ifndef JAXFUSE_RECORD
static XLA_FFI_Error* instantiate(XLA_FFI_CallFrame* frame) {
  (void)frame;
  return NULL;
}
#else
/* ------------------------------------------------------------ record stage */

/* The kernel image kept for the record stage (see Entry); NULL with *err. */
static const unsigned char* find_image(const XLA_FFI_Api* api, const Attrs* at, size_t* size,
                                       XLA_FFI_Error** err) {
  const unsigned char* out = NULL;
  pthread_mutex_lock(&g_lock);
  Entry* e = entry_for(at->kid, NULL);
  if (!e) {
    *err = table_full(api);
  } else if (e->data) {
    out = e->data;
    *size = e->size;
  } else if ((e->data = image_bytes(api, at, &e->size, err))) {
    e->kid = at->kid;
    e->ctx = NULL;
    ++g_entries;
    out = e->data;
    *size = e->size;
  }
  pthread_mutex_unlock(&g_lock);
  return out;
}

static XLA_FFI_Error* record_error(const XLA_FFI_Api* api, const char* what) {
  char msg[200];
  snprintf(msg, sizeof(msg), "jaxfuse direct launch (record stage): %s", what);
  return make_error(api, XLA_FFI_Error_Code_INTERNAL, msg);
}

/* The record stage: creates the launch as a kernel node of XLA's command
 * buffer, or updates its arguments. A call that zeroes a buffer before its
 * launch (a memset XLA's record API has no command for) asks XLA to capture
 * the execute stage instead, as it does for handlers without this stage. */
XLA_FFI_Error* jaxfuse_direct_record(XLA_FFI_CallFrame* frame) {
  if (frame->extension_start && frame->extension_start->type == XLA_FFI_Extension_Metadata)
    return answer_metadata(frame);
  const XLA_FFI_Api* api = frame->api;
  if (frame->stage != XLA_FFI_ExecutionStage_RECORD) return NULL;

  XLA_FFI_InvokeContext_FindExtension_Args fa;
  memset(&fa, 0, sizeof(fa));
  fa.struct_size = XLA_FFI_InvokeContext_FindExtension_Args_STRUCT_SIZE;
  fa.ctx = frame->ctx;
  fa.extension_type = XLA_FFI_Extension_Record;
  XLA_FFI_Error* e = api->XLA_FFI_InvokeContext_FindExtension(&fa);
  if (e) return e;
  if (!fa.extension) return record_error(api, "no record extension in the call");
  /* Built against one version of the extension; another is refused, not guessed at. */
  if (fa.extension->id.major_version != XLA_FFI_Extension_Record_MajorVersion ||
      fa.extension->id.minor_version != XLA_FFI_Extension_Record_MinorVersion)
    return record_error(api, "record extension of another version");
  const XLA_FFI_RecordFrame* rf = ((const XLA_FFI_Record_Extension*)fa.extension)->record_frame;
  const XLA_FFI_RecordApi* rapi = rf->api;

  Attrs at;
  if ((e = decode_call(frame, &at))) return e;
  for (int64_t i = 0; i < at.n_kinds; ++i)
    if (at.kinds[i] == 0 && at.values[i] > 0) return rapi->request_stream_capture(rf->record_ctx);

  uint64_t slots[kMaxParams + 2];
  if ((e = fill_slots(frame, &at, slots))) return e;
  /* A buffer is passed by its device address; a scalar by value, as the
   * 8 bytes of its slot (the driver reads the parameter's own size). */
  XLA_FFI_KernelArg args[kMaxParams + 2];
  int64_t n = at.n_kinds + 2;
  for (int64_t i = 0; i < n; ++i) {
    int buffer = i >= at.n_kinds || at.kinds[i] == 0;
    args[i].arg_address = buffer ? (const void*)(uintptr_t)slots[i] : (const void*)&slots[i];
    args[i].size = buffer ? 0 : (int64_t)sizeof(uint64_t);
    args[i].type = buffer ? XLA_FFI_KernelArgType_DevicePtr : XLA_FFI_KernelArgType_HostValue;
  }
  XLA_FFI_KernelArgs kargs = {args, n};

  if (rf->action == XLA_FFI_RecordAction_Update) {
    if (*rf->num_commands < 1) return record_error(api, "no recorded launch to update");
    return rapi->update_launch(rf->record_ctx, rf->commands[0], &kargs);
  }
  if (*rf->num_commands >= rf->max_commands) return record_error(api, "no room for a command");
  char name[256];
  if (kernel_name(&at, name))
    return make_error(api, XLA_FFI_Error_Code_INVALID_ARGUMENT, "kernel name too long");
  size_t size = 0;
  const unsigned char* image = find_image(api, &at, &size, &e);
  if (!image) return e;
  XLA_FFI_LaunchDims dims;
  memset(&dims, 0, sizeof(dims));
  dims.grid.x = (int32_t)at.grid[0];
  dims.grid.y = (int32_t)at.grid[1];
  dims.grid.z = (int32_t)at.grid[2];
  dims.block.x = (int32_t)at.block;
  dims.block.y = dims.block.z = 1;
  const XLA_FFI_Command* cmd = NULL;
  e = rapi->create_launch(rf->record_ctx, name, image, (int64_t)size,
                          at.image_kind == 1 ? XLA_FFI_SourceFormat_CUBIN : XLA_FFI_SourceFormat_PTX,
                          dims, (uint32_t)at.smem, (int32_t)at.uses_pdl, &kargs, NULL, 0, &cmd);
  if (e) return e;
  rf->commands[(*rf->num_commands)++] = cmd;
  return NULL;
}

/* Why registration happens here: jax registers a target's handlers through
 * the GPU plugin, which passes on the instantiate, prepare, initialize and
 * execute stages only (jax 0.11.2). XLA's own FFI API takes a whole bundle,
 * record stage included, and hands every handler that API. So a call whose
 * "register_record" attribute names a target, once instantiated (compiled),
 * registers that target with this file's execute and record stages. */
static int g_record_registered;

int jaxfuse_direct_record_registered(void) { return g_record_registered; }

static XLA_FFI_Error* instantiate(XLA_FFI_CallFrame* frame) {
  const XLA_FFI_Api* api = frame->api;
  const XLA_FFI_Attrs* attrs = &frame->attrs;
  for (int64_t i = 0; i < attrs->size; ++i) {
    if (attrs->types[i] != XLA_FFI_AttrType_STRING || !name_is(attrs->names[i], "register_record"))
      continue;
    const XLA_FFI_ByteSpan* target = (const XLA_FFI_ByteSpan*)attrs->attrs[i];
    XLA_FFI_Handler_Register_Args ra;
    memset(&ra, 0, sizeof(ra));
    ra.struct_size = XLA_FFI_Handler_Register_Args_STRUCT_SIZE;
    ra.name = *target;
    ra.platform.ptr = "CUDA";
    ra.platform.len = 4;
    ra.bundle.execute = jaxfuse_direct_launch;
    ra.bundle.record = jaxfuse_direct_record;
    ra.traits = g_traits;
    XLA_FFI_Error* e = api->XLA_FFI_Handler_Register(&ra);
    if (!e) g_record_registered = 1;
    return e;
  }
  return NULL;
}
#endif  /* JAXFUSE_RECORD */
