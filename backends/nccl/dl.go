//go:build cgo

package nccl

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// The few declarations of nccl.h and cuda_runtime.h this package needs,
// written by hand so that it builds without either header. Enums are ints
// in the C ABI; handles are pointers.
typedef int ft_result;
typedef void* ft_comm;
typedef void* ft_stream;
typedef struct { char internal[128]; } ft_uid;

// ncclConfig_t as it stood in NCCL 2.18 (its version field says so). NCCL
// copies min(size, its own sizeof) bytes over its defaults and resets the
// fields newer than version, so this honest prefix works with every
// NCCL >= 2.18.
typedef struct {
	size_t size;
	unsigned int magic;
	unsigned int version;
	int blocking;
	int cgaClusterSize;
	int minCTAs;
	int maxCTAs;
	const char* netName;
	int splitShare;
} ft_config;

// A cell is where a nonblocking NCCL writes a new communicator, possibly
// after the call returned; the config lives beside it for as long.
typedef struct {
	ft_comm comm;
	ft_config cfg;
	void* attached[2]; // C memory NCCL may read after the call: freed with the cell
} ft_cell;

static uintptr_t ft_cell_new(void) { return (uintptr_t)calloc(1, sizeof(ft_cell)); }
static uintptr_t ft_cell_load(uintptr_t cell) {
	return (uintptr_t)__atomic_load_n(&((ft_cell*)cell)->comm, __ATOMIC_ACQUIRE);
}
static int ft_cell_attach(uintptr_t cell, void* p) {
	ft_cell* c = (ft_cell*)cell;
	for (int i = 0; i < 2; i++) if (c->attached[i] == NULL) { c->attached[i] = p; return 0; }
	return -1;
}
static void ft_cell_free(uintptr_t cell) {
	ft_cell* c = (ft_cell*)cell;
	for (int i = 0; i < 2; i++) free(c->attached[i]);
	free(c);
}

// One enqueue call (layout mirrored by libapi.CollArgs (internal/libapi)).
typedef struct {
	int32_t kind, dtype, redop, peer;
	uintptr_t send, recv;
	uint64_t count;
} ft_gop;

typedef struct {
	void* nccl;
	void* cudart;
	// NCCL, required
	ft_result (*getVersion)(int*);
	ft_result (*getUniqueId)(ft_uid*);
	ft_result (*commInitRankConfig)(ft_comm*, int, ft_uid, int, ft_config*);
	ft_result (*commAbort)(ft_comm);
	ft_result (*commGetAsyncError)(ft_comm, ft_result*);
	ft_result (*commCount)(ft_comm, int*);
	ft_result (*commUserRank)(ft_comm, int*);
	const char* (*getErrorString)(ft_result);
	ft_result (*allReduce)(const void*, void*, size_t, int, int, ft_comm, ft_stream);
	ft_result (*broadcast)(const void*, void*, size_t, int, int, ft_comm, ft_stream);
	ft_result (*reduce)(const void*, void*, size_t, int, int, int, ft_comm, ft_stream);
	ft_result (*allGather)(const void*, void*, size_t, int, ft_comm, ft_stream);
	ft_result (*reduceScatter)(const void*, void*, size_t, int, int, ft_comm, ft_stream);
	ft_result (*send)(const void*, size_t, int, int, ft_comm, ft_stream);
	ft_result (*recv)(void*, size_t, int, int, ft_comm, ft_stream);
	ft_result (*groupStart)(void);
	ft_result (*groupEnd)(void);
	// NCCL, optional (NULL when the library predates them)
	const char* (*getLastError)(ft_comm);
	ft_result (*commSplit)(ft_comm, int, int, ft_comm*, ft_config*);
	ft_result (*commShrink)(ft_comm, int*, int, ft_comm*, ft_config*, int);
	ft_result (*commRevoke)(ft_comm, int);
	ft_result (*commGrow)(ft_comm, int, const ft_uid*, int, ft_comm*, ft_config*);
	ft_result (*commGetUniqueId)(ft_comm, ft_uid*);
	ft_result (*alltoAll)(const void*, void*, size_t, int, ft_comm, ft_stream);
	ft_result (*gather)(const void*, void*, size_t, int, int, ft_comm, ft_stream);
	ft_result (*scatter)(const void*, void*, size_t, int, int, ft_comm, ft_stream);
	// CUDA runtime
	int (*setDevice)(int);
	int (*getDevice)(int*);
	int (*getDeviceCount)(int*);
	int (*runtimeGetVersion)(int*);
	int (*driverGetVersion)(int*);
	int (*malloc)(void**, size_t);
	int (*free)(void*);
	int (*memcpyAsync)(void*, const void*, size_t, int, ft_stream);
	int (*memsetAsync)(void*, int, size_t, ft_stream);
	int (*hostAlloc)(void**, size_t, unsigned int);
	int (*freeHost)(void*);
	int (*deviceGetPCIBusId)(char*, int, int);
	int (*streamCreateWithFlags)(ft_stream*, unsigned int);
	int (*streamDestroy)(ft_stream);
	int (*streamQuery)(ft_stream);
	int (*eventCreateWithFlags)(void**, unsigned int);
	int (*eventDestroy)(void*);
	int (*eventRecord)(void*, ft_stream);
	int (*streamWaitEvent)(ft_stream, void*, unsigned int);
	int (*eventQuery)(void*);
	int (*eventElapsedTime)(float*, void*, void*);
	const char* (*cudaGetErrorString)(int);
} ft_lib;

// ft_dlopen opens path and returns its handle, or NULL with *err set to a
// malloc'd copy of dlerror's text (dlerror is per thread, so it must be
// read in the same C call).
static void* ft_dlopen(const char* path, char** err) {
	dlerror();
	void* h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (h == NULL) {
		const char* e = dlerror();
		*err = strdup(e ? e : "dlopen failed");
	}
	return h;
}

static int ft_dlsym_present(void* h, const char* name) { return h && dlsym(h, name) != NULL; }

// ft_cudart_driver_version is cudaDriverGetVersion through a libcudart
// handle (0 if absent or failing): the newest CUDA the driver supports.
static int ft_cudart_driver_version(void* h) {
	int (*f)(int*) = (int (*)(int*))dlsym(h, "cudaDriverGetVersion");
	int v = 0;
	if (f == NULL || f(&v) != 0) return 0;
	return v;
}

#define FT_SYM(h, field, name, required) do { \
	*(void**)(&L->field) = dlsym(h, name); \
	if ((required) && L->field == NULL && *missing == NULL) *missing = name; \
} while (0)

// ft_resolve fills L from its two handles; *missing names the first
// required symbol not found.
static void ft_resolve(ft_lib* L, const char** missing) {
	void* n = L->nccl;
	void* c = L->cudart;
	*missing = NULL;
	FT_SYM(n, getVersion, "ncclGetVersion", 1);
	FT_SYM(n, getUniqueId, "ncclGetUniqueId", 1);
	FT_SYM(n, commInitRankConfig, "ncclCommInitRankConfig", 1);
	FT_SYM(n, commAbort, "ncclCommAbort", 1);
	FT_SYM(n, commGetAsyncError, "ncclCommGetAsyncError", 1);
	FT_SYM(n, commCount, "ncclCommCount", 1);
	FT_SYM(n, commUserRank, "ncclCommUserRank", 1);
	FT_SYM(n, getErrorString, "ncclGetErrorString", 1);
	FT_SYM(n, allReduce, "ncclAllReduce", 1);
	FT_SYM(n, broadcast, "ncclBroadcast", 1);
	FT_SYM(n, reduce, "ncclReduce", 1);
	FT_SYM(n, allGather, "ncclAllGather", 1);
	FT_SYM(n, reduceScatter, "ncclReduceScatter", 1);
	FT_SYM(n, send, "ncclSend", 1);
	FT_SYM(n, recv, "ncclRecv", 1);
	FT_SYM(n, groupStart, "ncclGroupStart", 1);
	FT_SYM(n, groupEnd, "ncclGroupEnd", 1);
	FT_SYM(n, getLastError, "ncclGetLastError", 0);
	FT_SYM(n, commSplit, "ncclCommSplit", 0);
	FT_SYM(n, commShrink, "ncclCommShrink", 0);
	FT_SYM(n, commRevoke, "ncclCommRevoke", 0);
	FT_SYM(n, commGrow, "ncclCommGrow", 0);
	FT_SYM(n, commGetUniqueId, "ncclCommGetUniqueId", 0);
	FT_SYM(n, alltoAll, "ncclAlltoAll", 0);
	FT_SYM(n, gather, "ncclGather", 0);
	FT_SYM(n, scatter, "ncclScatter", 0);
	FT_SYM(c, setDevice, "cudaSetDevice", 1);
	FT_SYM(c, getDevice, "cudaGetDevice", 1);
	FT_SYM(c, getDeviceCount, "cudaGetDeviceCount", 1);
	FT_SYM(c, runtimeGetVersion, "cudaRuntimeGetVersion", 1);
	FT_SYM(c, driverGetVersion, "cudaDriverGetVersion", 1);
	FT_SYM(c, malloc, "cudaMalloc", 1);
	FT_SYM(c, free, "cudaFree", 1);
	FT_SYM(c, memcpyAsync, "cudaMemcpyAsync", 1);
	FT_SYM(c, memsetAsync, "cudaMemsetAsync", 1);
	FT_SYM(c, hostAlloc, "cudaHostAlloc", 1);
	FT_SYM(c, freeHost, "cudaFreeHost", 1);
	FT_SYM(c, deviceGetPCIBusId, "cudaDeviceGetPCIBusId", 1);
	FT_SYM(c, streamCreateWithFlags, "cudaStreamCreateWithFlags", 1);
	FT_SYM(c, streamDestroy, "cudaStreamDestroy", 1);
	FT_SYM(c, streamQuery, "cudaStreamQuery", 1);
	FT_SYM(c, eventCreateWithFlags, "cudaEventCreateWithFlags", 1);
	FT_SYM(c, eventDestroy, "cudaEventDestroy", 1);
	FT_SYM(c, eventRecord, "cudaEventRecord", 1);
	FT_SYM(c, streamWaitEvent, "cudaStreamWaitEvent", 1);
	FT_SYM(c, eventQuery, "cudaEventQuery", 1);
	FT_SYM(c, eventElapsedTime, "cudaEventElapsedTime", 1);
	FT_SYM(c, cudaGetErrorString, "cudaGetErrorString", 1);
}

// ft_use makes dev current on this thread. Every entry that depends on the
// current device calls it inside the same C call, so a goroutine moving to
// another OS thread between calls cannot run on the wrong device.
static int ft_use(ft_lib* L, int dev) {
	int cur = -1;
	if (L->getDevice(&cur) == 0 && cur == dev) return 0;
	return L->setDevice(dev);
}

static void ft_config_init(ft_config* c, int blocking) {
	memset(c, 0, sizeof *c);
	c->size = sizeof *c;
	c->magic = 0xcafebeef;
	c->version = 21800; // NCCL 2.18.0
	c->blocking = blocking;
	c->cgaClusterSize = INT_MIN;
	c->minCTAs = INT_MIN;
	c->maxCTAs = INT_MIN;
	c->netName = NULL;
	c->splitShare = INT_MIN;
}

static int ft_get_version(ft_lib* L) { int v = 0; if (L->getVersion(&v) != 0) return 0; return v; }

static int ft_comm_init(ft_lib* L, int dev, uintptr_t cell, int nranks, const void* id, int rank, int blocking, int splitShare) {
	ft_cell* c = (ft_cell*)cell;
	if (ft_use(L, dev) != 0) return 1; // ncclUnhandledCudaError
	ft_config_init(&c->cfg, blocking);
	if (splitShare) c->cfg.splitShare = 1;
	ft_uid uid;
	memcpy(&uid, id, sizeof uid);
	return L->commInitRankConfig(&c->comm, nranks, uid, rank, &c->cfg);
}

static int ft_comm_grow(ft_lib* L, int dev, uintptr_t comm, int nranks, const void* id, int rank, uintptr_t cell, int blocking) {
	ft_cell* c = (ft_cell*)cell;
	if (L->commGrow == NULL) return 5; // ncclInvalidUsage
	if (ft_use(L, dev) != 0) return 1;
	ft_config* cfg = NULL;
	if (comm == 0) { // a joiner brings its own config
		ft_config_init(&c->cfg, blocking);
		cfg = &c->cfg;
	}
	return L->commGrow((ft_comm)comm, nranks, (const ft_uid*)id, rank, &c->comm, cfg);
}

// blocking < 0: the child inherits the parent's config (NULL); else it
// gets a config of its own with that blocking mode, kept in the cell.
static int ft_comm_split(ft_lib* L, uintptr_t comm, int color, int key, uintptr_t cell, int blocking) {
	ft_cell* c = (ft_cell*)cell;
	if (L->commSplit == NULL) return 5;
	ft_config* cfg = NULL;
	if (blocking >= 0) {
		ft_config_init(&c->cfg, blocking);
		cfg = &c->cfg;
	}
	return L->commSplit((ft_comm)comm, color, key, &c->comm, cfg);
}

static int ft_comm_shrink(ft_lib* L, uintptr_t comm, int* exclude, int n, uintptr_t cell, int blocking, int flags) {
	ft_cell* c = (ft_cell*)cell;
	if (L->commShrink == NULL) return 5;
	ft_config* cfg = NULL;
	if (blocking >= 0) {
		ft_config_init(&c->cfg, blocking);
		cfg = &c->cfg;
	}
	return L->commShrink((ft_comm)comm, exclude, n, &c->comm, cfg, flags);
}

static int ft_comm_revoke(ft_lib* L, uintptr_t comm) {
	if (L->commRevoke == NULL) return 5;
	return L->commRevoke((ft_comm)comm, 0);
}

static int ft_comm_get_uid(ft_lib* L, uintptr_t comm, void* id) {
	if (L->commGetUniqueId == NULL) return 5;
	return L->commGetUniqueId((ft_comm)comm, (ft_uid*)id);
}

static int ft_async_error(ft_lib* L, uintptr_t comm, int* async) {
	ft_result a = 0;
	int r = L->commGetAsyncError((ft_comm)comm, &a);
	*async = a;
	return r;
}

static const char* ft_last_error(ft_lib* L, uintptr_t comm) {
	if (L->getLastError == NULL) return "";
	return L->getLastError((ft_comm)comm);
}

static int ft_enqueue_on(ft_lib* L, int dev, uintptr_t comm, uintptr_t stream, const ft_gop* a);

static int ft_enqueue(ft_lib* L, uintptr_t comm, uintptr_t stream, const ft_gop* a) {
	ft_comm c = (ft_comm)comm;
	ft_stream s = (ft_stream)stream;
	const void* in = (const void*)a->send;
	void* out = (void*)a->recv;
	switch (a->kind) {
	case 1: return L->allReduce(in, out, a->count, a->dtype, a->redop, c, s);
	case 2: return L->broadcast(in, out, a->count, a->dtype, a->peer, c, s);
	case 3: return L->reduce(in, out, a->count, a->dtype, a->redop, a->peer, c, s);
	case 4: return L->allGather(in, out, a->count, a->dtype, c, s);
	case 5: return L->reduceScatter(in, out, a->count, a->dtype, a->redop, c, s);
	case 6: return L->alltoAll ? L->alltoAll(in, out, a->count, a->dtype, c, s) : 5;
	case 7: return L->gather ? L->gather(in, out, a->count, a->dtype, a->peer, c, s) : 5;
	case 8: return L->scatter ? L->scatter(in, out, a->count, a->dtype, a->peer, c, s) : 5;
	case 9: return L->send(in, a->count, a->dtype, a->peer, c, s);
	case 10: return L->recv(out, a->count, a->dtype, a->peer, c, s);
	}
	return 4; // ncclInvalidArgument
}

static int ft_enqueue_on(ft_lib* L, int dev, uintptr_t comm, uintptr_t stream, const ft_gop* a) {
	if (ft_use(L, dev) != 0) return 1;
	return ft_enqueue(L, comm, stream, a);
}

// ft_group issues ops between ncclGroupStart and ncclGroupEnd on one
// thread. A failing call ends the group early; ncclGroupEnd still runs so
// the thread's group state is closed.
static int ft_group(ft_lib* L, int dev, uintptr_t comm, uintptr_t stream, const ft_gop* ops, int n) {
	if (ft_use(L, dev) != 0) return 1;
	int r = L->groupStart();
	if (r != 0) return r;
	int first = 0;
	for (int i = 0; i < n && first == 0; i++) {
		int e = ft_enqueue(L, comm, stream, &ops[i]);
		if (e != 0 && e != 7) first = e;
	}
	int e = L->groupEnd();
	return first != 0 ? first : e;
}

static int ft_get_uid(ft_lib* L, void* id) { return L->getUniqueId((ft_uid*)id); }
static int ft_comm_count(ft_lib* L, uintptr_t comm, int* n) { return L->commCount((ft_comm)comm, n); }
static int ft_comm_user_rank(ft_lib* L, uintptr_t comm, int* r) { return L->commUserRank((ft_comm)comm, r); }
static int ft_comm_abort(ft_lib* L, uintptr_t comm) { return L->commAbort((ft_comm)comm); }
static const char* ft_error_string(ft_lib* L, int r) { return L->getErrorString(r); }

static int ft_device_count(ft_lib* L, int* n) { return L->getDeviceCount(n); }
static int ft_runtime_version(ft_lib* L) { int v = 0; L->runtimeGetVersion(&v); return v; }
static int ft_driver_version(ft_lib* L) { int v = 0; L->driverGetVersion(&v); return v; }

static int ft_malloc(ft_lib* L, int dev, size_t n, uintptr_t* out) {
	int e = ft_use(L, dev);
	if (e != 0) return e;
	void* p = NULL;
	e = L->malloc(&p, n);
	*out = (uintptr_t)p;
	return e;
}

static int ft_free(ft_lib* L, int dev, uintptr_t p) {
	int e = ft_use(L, dev);
	if (e != 0) return e;
	return L->free((void*)p);
}

// kind: 1 host to device, 2 device to host, 3 device to device.
static int ft_memcpy(ft_lib* L, int dev, uintptr_t dst, uintptr_t src, size_t n, int kind, uintptr_t stream) {
	int e = ft_use(L, dev);
	if (e != 0) return e;
	return L->memcpyAsync((void*)dst, (const void*)src, n, kind, (ft_stream)stream);
}

static int ft_memcpy_h2d(ft_lib* L, int dev, uintptr_t dst, const void* src, size_t n, uintptr_t stream) {
	int e = ft_use(L, dev);
	if (e != 0) return e;
	return L->memcpyAsync((void*)dst, src, n, 1, (ft_stream)stream);
}

static int ft_memcpy_d2h(ft_lib* L, int dev, void* dst, uintptr_t src, size_t n, uintptr_t stream) {
	int e = ft_use(L, dev);
	if (e != 0) return e;
	return L->memcpyAsync(dst, (const void*)src, n, 2, (ft_stream)stream);
}

static int ft_memset(ft_lib* L, int dev, uintptr_t p, int v, size_t n, uintptr_t stream) {
	int e = ft_use(L, dev);
	if (e != 0) return e;
	return L->memsetAsync((void*)p, v, n, (ft_stream)stream);
}

// flags: cudaHostAllocPortable (1), so the memory is page-locked for every
// device's context.
static int ft_host_alloc(ft_lib* L, int dev, size_t n, void** out) {
	int e = ft_use(L, dev);
	if (e != 0) return e;
	*out = NULL;
	return L->hostAlloc(out, n, 1);
}

static int ft_free_host(ft_lib* L, void* p) { return L->freeHost(p); }

static int ft_pci_bus_id(ft_lib* L, int dev, char* buf, int n) { return L->deviceGetPCIBusId(buf, n, dev); }

static int ft_stream_create(ft_lib* L, int dev, uintptr_t* out) {
	int e = ft_use(L, dev);
	if (e != 0) return e;
	ft_stream s = NULL;
	e = L->streamCreateWithFlags(&s, 1); // cudaStreamNonBlocking
	*out = (uintptr_t)s;
	return e;
}

static int ft_stream_destroy(ft_lib* L, int dev, uintptr_t s) {
	int e = ft_use(L, dev);
	if (e != 0) return e;
	return L->streamDestroy((ft_stream)s);
}

// 0 done, 600 (cudaErrorNotReady) pending, else an error.
static int ft_stream_query(ft_lib* L, uintptr_t s) { return L->streamQuery((ft_stream)s); }

// flags: cudaEventDisableTiming (2) unless timing is asked for.
static int ft_event_create(ft_lib* L, int dev, int timing, uintptr_t* out) {
	int e = ft_use(L, dev);
	if (e != 0) return e;
	void* ev = NULL;
	e = L->eventCreateWithFlags(&ev, timing ? 0 : 2);
	*out = (uintptr_t)ev;
	return e;
}

static int ft_event_destroy(ft_lib* L, int dev, uintptr_t ev) {
	int e = ft_use(L, dev);
	if (e != 0) return e;
	return L->eventDestroy((void*)ev);
}

static int ft_event_record(ft_lib* L, int dev, uintptr_t ev, uintptr_t s) {
	int e = ft_use(L, dev);
	if (e != 0) return e;
	return L->eventRecord((void*)ev, (ft_stream)s);
}

static int ft_stream_wait_event(ft_lib* L, int dev, uintptr_t s, uintptr_t ev) {
	int e = ft_use(L, dev);
	if (e != 0) return e;
	return L->streamWaitEvent((ft_stream)s, (void*)ev, 0);
}

static int ft_event_query(ft_lib* L, uintptr_t ev) { return L->eventQuery((void*)ev); }

static int ft_event_elapsed(ft_lib* L, uintptr_t a, uintptr_t b, float* ms) {
	return L->eventElapsedTime(ms, (void*)a, (void*)b);
}

static const char* ft_cuda_error(ft_lib* L, int e) { return L->cudaGetErrorString(e); }
*/
import "C"

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"unsafe"

	"github.com/ftcomm/ftcomm/backends/nccl/internal/libapi"
	"github.com/ftcomm/ftcomm/comm"
)

// cudaErrorNotReady is what cudaStreamQuery returns while work is pending.
const cudaErrorNotReady = 600

// optionalSymbols are the NCCL entry points probed and reported by
// Library.Symbols.
var optionalSymbols = [...]string{"ncclGetLastError", "ncclCommSplit", "ncclCommShrink", "ncclCommRevoke",
	"ncclCommGrow", "ncclCommGetUniqueId", "ncclAlltoAll", "ncclGather", "ncclScatter",
	"ncclCommFinalize", "ncclCommDestroy"}

// dlLibrary is the real library: NCCL and the CUDA runtime opened with
// dlopen. Libraries are never closed: NCCL keeps threads and atexit
// handlers that must outlive any communicator.
type dlLibrary struct {
	L          *C.ft_lib // C memory; lives as long as the process
	ncclPath   string
	cudartPath string
	ver        int
	syms       map[string]bool
}

var _ libapi.Library = (*dlLibrary)(nil)

func dlopen(path string) (unsafe.Pointer, error) {
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	var cerr *C.char
	h := C.ft_dlopen(cpath, &cerr)
	if h == nil {
		msg := C.GoString(cerr)
		C.free(unsafe.Pointer(cerr))
		return nil, fmt.Errorf("nccl: %w: %s", comm.ErrBackendUnavailable, msg)
	}
	return h, nil
}

// cudartCandidates lists where to look for the CUDA runtime when no path is
// given: the loader's search path first, then the usual install locations.
func cudartCandidates() []string {
	names := []string{"libcudart.so.13", "libcudart.so.12"}
	out := append([]string(nil), names...)
	var dirs []string
	for _, env := range []string{"CUDA_HOME", "CUDA_PATH"} {
		if d := os.Getenv(env); d != "" {
			dirs = append(dirs, filepath.Join(d, "lib64"), filepath.Join(d, "lib"))
		}
	}
	dirs = append(dirs, "/usr/local/cuda/lib64")
	for _, pat := range []string{"/usr/local/cuda-13*/lib64", "/usr/local/cuda-12*/lib64",
		"/usr/local/cuda-13*/targets/*/lib", "/usr/local/cuda-12*/targets/*/lib"} {
		m, _ := filepath.Glob(pat)
		dirs = append(dirs, m...)
	}
	for _, d := range dirs {
		for _, n := range names {
			out = append(out, filepath.Join(d, n))
		}
	}
	return out
}

// openCUDART opens the CUDA runtime at path, or the first of
// cudartCandidates that loads.
func openCUDART(path string) (unsafe.Pointer, string, error) {
	if path != "" {
		h, err := dlopen(path)
		return h, path, err
	}
	var first error
	for _, cand := range cudartCandidates() {
		h, err := dlopen(cand)
		if err == nil {
			return h, cand, nil
		}
		if first == nil {
			first = err
		}
	}
	return nil, "", fmt.Errorf("%w (also tried the CUDA install directories; set FTCOMM_CUDART_LIB)", first)
}

// probeDriverCUDA is the newest CUDA version the driver supports
// (cudaDriverGetVersion, e.g. 13000), or 0 if the runtime does not load.
// The runtime stays loaded, as openLibrary loads it anyway.
func probeDriverCUDA(cudartPath string) int {
	h, _, err := openCUDART(cudartPath)
	if err != nil {
		return 0
	}
	return int(C.ft_cudart_driver_version(h))
}

// openLibrary opens NCCL and the CUDA runtime. An empty path means the
// default search. A libnccl that does not load or lacks a required entry
// point is an *ncclLoadError.
func openLibrary(ncclPath, cudartPath string) (*dlLibrary, error) {
	if unsafe.Sizeof(libapi.CollArgs{}) != C.sizeof_ft_gop {
		return nil, fmt.Errorf("nccl: internal error: libapi.CollArgs is %d bytes, ft_gop %d", unsafe.Sizeof(libapi.CollArgs{}), C.sizeof_ft_gop)
	}
	if ncclPath == "" {
		ncclPath = ncclSoname
	}
	hn, err := dlopen(ncclPath)
	if err != nil {
		return nil, &ncclLoadError{err}
	}
	hc, cudartPath, err := openCUDART(cudartPath)
	if err != nil {
		return nil, err
	}
	L := (*C.ft_lib)(C.calloc(1, C.sizeof_ft_lib))
	L.nccl, L.cudart = hn, hc
	var missing *C.char
	C.ft_resolve(L, &missing)
	if missing != nil {
		name := C.GoString(missing)
		C.free(unsafe.Pointer(L))
		err := fmt.Errorf("nccl: %w: symbol %s not found in %s or %s", comm.ErrBackendUnavailable, name, ncclPath, cudartPath)
		if strings.HasPrefix(name, "nccl") {
			return nil, &ncclLoadError{err}
		}
		return nil, err
	}
	d := &dlLibrary{L: L, ncclPath: ncclPath, cudartPath: cudartPath, syms: map[string]bool{}}
	d.ver = int(C.ft_get_version(L))
	for _, s := range optionalSymbols {
		cs := C.CString(s)
		d.syms[s] = C.ft_dlsym_present(hn, cs) != 0
		C.free(unsafe.Pointer(cs))
	}
	return d, nil
}

func (d *dlLibrary) Version() int               { return d.ver }
func (d *dlLibrary) HasSymbol(name string) bool { return d.syms[name] }

func (d *dlLibrary) GetUniqueID(id *libapi.UniqueID) libapi.Result {
	return libapi.Result(C.ft_get_uid(d.L, unsafe.Pointer(id)))
}

func (d *dlLibrary) CommInitRank(dev int, out libapi.Cell, nranks int, id *libapi.UniqueID, rank int, cfg libapi.CommConfig) libapi.Result {
	return libapi.Result(C.ft_comm_init(d.L, C.int(dev), C.uintptr_t(out), C.int(nranks), unsafe.Pointer(id), C.int(rank), cbool(cfg.Blocking), cbool(cfg.SplitShare)))
}

func (d *dlLibrary) CommSplit(c libapi.Comm, color, key int, out libapi.Cell, cfg libapi.ChildConfig) libapi.Result {
	return libapi.Result(C.ft_comm_split(d.L, C.uintptr_t(c), C.int(color), C.int(key), C.uintptr_t(out), childBlocking(cfg)))
}

// childBlocking is the blocking argument of ft_comm_split and
// ft_comm_shrink: -1 passes no config (the child inherits the parent's).
func childBlocking(cfg libapi.ChildConfig) C.int {
	if cfg.Inherit {
		return -1
	}
	return cbool(cfg.Blocking)
}

func (d *dlLibrary) CommShrink(c libapi.Comm, exclude []int32, out libapi.Cell, cfg libapi.ChildConfig, flags int) libapi.Result {
	// The list is copied to C memory: a nonblocking NCCL may read it after
	// the call returns.
	n := len(exclude)
	p := (*C.int)(C.malloc(C.size_t(max(n, 1)) * C.sizeof_int))
	copy(unsafe.Slice((*int32)(unsafe.Pointer(p)), max(n, 1)), exclude)
	d.attach(out, unsafe.Pointer(p)) // freed with the cell
	return libapi.Result(C.ft_comm_shrink(d.L, C.uintptr_t(c), p, C.int(n), C.uintptr_t(out), childBlocking(cfg), C.int(flags)))
}

func (d *dlLibrary) CommGrow(dev int, c libapi.Comm, nranks int, id *libapi.UniqueID, rank int, out libapi.Cell, cfg libapi.CommConfig) libapi.Result {
	var idp unsafe.Pointer
	if id != nil {
		cid := C.malloc(C.size_t(len(id)))
		copy(unsafe.Slice((*byte)(cid), len(id)), id[:])
		d.attach(out, cid)
		idp = cid
	}
	return libapi.Result(C.ft_comm_grow(d.L, C.int(dev), C.uintptr_t(c), C.int(nranks), idp, C.int(rank), C.uintptr_t(out), cbool(cfg.Blocking)))
}

func (d *dlLibrary) CommGetUniqueID(c libapi.Comm, id *libapi.UniqueID) libapi.Result {
	return libapi.Result(C.ft_comm_get_uid(d.L, C.uintptr_t(c), unsafe.Pointer(id)))
}

func (d *dlLibrary) CommCount(c libapi.Comm) (int, libapi.Result) {
	var n C.int
	r := libapi.Result(C.ft_comm_count(d.L, C.uintptr_t(c), &n))
	return int(n), r
}

func (d *dlLibrary) CommUserRank(c libapi.Comm) (int, libapi.Result) {
	var n C.int
	r := libapi.Result(C.ft_comm_user_rank(d.L, C.uintptr_t(c), &n))
	return int(n), r
}

func (d *dlLibrary) CommRevoke(c libapi.Comm) libapi.Result {
	return libapi.Result(C.ft_comm_revoke(d.L, C.uintptr_t(c)))
}

func (d *dlLibrary) CommAbort(c libapi.Comm) libapi.Result {
	return libapi.Result(C.ft_comm_abort(d.L, C.uintptr_t(c)))
}

func (d *dlLibrary) CommGetAsyncError(c libapi.Comm) (async, r libapi.Result) {
	var a C.int
	r = libapi.Result(C.ft_async_error(d.L, C.uintptr_t(c), &a))
	return libapi.Result(a), r
}

func (d *dlLibrary) ErrorString(r libapi.Result) string {
	return C.GoString(C.ft_error_string(d.L, C.int(r)))
}

func (d *dlLibrary) LastError(c libapi.Comm) string {
	return C.GoString(C.ft_last_error(d.L, C.uintptr_t(c)))
}

func (d *dlLibrary) Enqueue(dev int, c libapi.Comm, s libapi.Stream, a *libapi.CollArgs) libapi.Result {
	return libapi.Result(C.ft_enqueue_on(d.L, C.int(dev), C.uintptr_t(c), C.uintptr_t(s), (*C.ft_gop)(unsafe.Pointer(a))))
}

func (d *dlLibrary) Group(dev int, c libapi.Comm, s libapi.Stream, ops []libapi.CollArgs) libapi.Result {
	if len(ops) == 0 {
		return libapi.Success
	}
	return libapi.Result(C.ft_group(d.L, C.int(dev), C.uintptr_t(c), C.uintptr_t(s), (*C.ft_gop)(unsafe.Pointer(&ops[0])), C.int(len(ops))))
}

func (d *dlLibrary) NewCell() libapi.Cell { return libapi.Cell(C.ft_cell_new()) }

// attach ties p (C memory) to cell: it is freed with the cell.
func (d *dlLibrary) attach(cell libapi.Cell, p unsafe.Pointer) {
	if C.ft_cell_attach(C.uintptr_t(cell), p) != 0 {
		panic("nccl: cell attachments exhausted") // programming error: at most two per cell
	}
}

func (d *dlLibrary) LoadCell(cell libapi.Cell) libapi.Comm {
	return libapi.Comm(C.ft_cell_load(C.uintptr_t(cell)))
}

func (d *dlLibrary) FreeCell(cell libapi.Cell) { C.ft_cell_free(C.uintptr_t(cell)) }

func cbool(b bool) C.int {
	if b {
		return 1
	}
	return 0
}

// ---- CUDA runtime ----

func (d *dlLibrary) cudaErr(op string, e C.int) error {
	if e == 0 {
		return nil
	}
	return &libapi.CUDAError{Op: op, Code: int(e), Msg: C.GoString(C.ft_cuda_error(d.L, e))}
}

func (d *dlLibrary) RuntimeVersion() int { return int(C.ft_runtime_version(d.L)) }
func (d *dlLibrary) DriverVersion() int  { return int(C.ft_driver_version(d.L)) }

func (d *dlLibrary) DeviceCount() (int, error) {
	var n C.int
	if err := d.cudaErr("cudaGetDeviceCount", C.ft_device_count(d.L, &n)); err != nil {
		return 0, err
	}
	return int(n), nil
}

func (d *dlLibrary) Malloc(dev int, n int) (uintptr, error) {
	var p C.uintptr_t
	if err := d.cudaErr("cudaMalloc", C.ft_malloc(d.L, C.int(dev), C.size_t(n), &p)); err != nil {
		return 0, err
	}
	return uintptr(p), nil
}

func (d *dlLibrary) Free(dev int, p uintptr) error {
	return d.cudaErr("cudaFree", C.ft_free(d.L, C.int(dev), C.uintptr_t(p)))
}

func (d *dlLibrary) CopyHtoD(dev int, dst uintptr, src []byte, s libapi.Stream) error {
	if len(src) == 0 {
		return nil
	}
	e := C.ft_memcpy_h2d(d.L, C.int(dev), C.uintptr_t(dst), unsafe.Pointer(&src[0]), C.size_t(len(src)), C.uintptr_t(s))
	runtime.KeepAlive(src)
	return d.cudaErr("cudaMemcpyAsync(HtoD)", e)
}

func (d *dlLibrary) CopyDtoH(dev int, dst []byte, src uintptr, s libapi.Stream) error {
	if len(dst) == 0 {
		return nil
	}
	e := C.ft_memcpy_d2h(d.L, C.int(dev), unsafe.Pointer(&dst[0]), C.uintptr_t(src), C.size_t(len(dst)), C.uintptr_t(s))
	runtime.KeepAlive(dst)
	return d.cudaErr("cudaMemcpyAsync(DtoH)", e)
}

func (d *dlLibrary) CopyDtoD(dev int, dst, src uintptr, n int, s libapi.Stream) error {
	return d.cudaErr("cudaMemcpyAsync(DtoD)", C.ft_memcpy(d.L, C.int(dev), C.uintptr_t(dst), C.uintptr_t(src), C.size_t(n), 3, C.uintptr_t(s)))
}

func (d *dlLibrary) Memset(dev int, p uintptr, v byte, n int, s libapi.Stream) error {
	return d.cudaErr("cudaMemsetAsync", C.ft_memset(d.L, C.int(dev), C.uintptr_t(p), C.int(v), C.size_t(n), C.uintptr_t(s)))
}

func (d *dlLibrary) HostAlloc(dev int, n int) ([]byte, error) {
	var p unsafe.Pointer
	if err := d.cudaErr("cudaHostAlloc", C.ft_host_alloc(d.L, C.int(dev), C.size_t(n), &p)); err != nil {
		return nil, err
	}
	return unsafe.Slice((*byte)(p), n), nil
}

func (d *dlLibrary) HostFree(buf []byte) error {
	return d.cudaErr("cudaFreeHost", C.ft_free_host(d.L, unsafe.Pointer(unsafe.SliceData(buf))))
}

func (d *dlLibrary) PCIBusID(dev int) (string, error) {
	var buf [64]C.char
	if err := d.cudaErr("cudaDeviceGetPCIBusId", C.ft_pci_bus_id(d.L, C.int(dev), &buf[0], C.int(len(buf)))); err != nil {
		return "", err
	}
	return C.GoString(&buf[0]), nil
}

func (d *dlLibrary) StreamCreate(dev int) (libapi.Stream, error) {
	var s C.uintptr_t
	if err := d.cudaErr("cudaStreamCreateWithFlags", C.ft_stream_create(d.L, C.int(dev), &s)); err != nil {
		return 0, err
	}
	return libapi.Stream(s), nil
}

func (d *dlLibrary) StreamDestroy(dev int, s libapi.Stream) error {
	return d.cudaErr("cudaStreamDestroy", C.ft_stream_destroy(d.L, C.int(dev), C.uintptr_t(s)))
}

func (d *dlLibrary) StreamQuery(dev int, s libapi.Stream) (bool, error) {
	switch e := C.ft_stream_query(d.L, C.uintptr_t(s)); e {
	case 0:
		return true, nil
	case cudaErrorNotReady:
		return false, nil
	default:
		return false, d.cudaErr("cudaStreamQuery", e)
	}
}

func (d *dlLibrary) EventCreate(dev int, timing bool) (libapi.Event, error) {
	var ev C.uintptr_t
	if err := d.cudaErr("cudaEventCreateWithFlags", C.ft_event_create(d.L, C.int(dev), cbool(timing), &ev)); err != nil {
		return 0, err
	}
	return libapi.Event(ev), nil
}

func (d *dlLibrary) EventDestroy(dev int, ev libapi.Event) error {
	return d.cudaErr("cudaEventDestroy", C.ft_event_destroy(d.L, C.int(dev), C.uintptr_t(ev)))
}

func (d *dlLibrary) EventRecord(dev int, ev libapi.Event, s libapi.Stream) error {
	return d.cudaErr("cudaEventRecord", C.ft_event_record(d.L, C.int(dev), C.uintptr_t(ev), C.uintptr_t(s)))
}

func (d *dlLibrary) StreamWaitEvent(dev int, s libapi.Stream, ev libapi.Event) error {
	return d.cudaErr("cudaStreamWaitEvent", C.ft_stream_wait_event(d.L, C.int(dev), C.uintptr_t(s), C.uintptr_t(ev)))
}

func (d *dlLibrary) EventQuery(ev libapi.Event) (bool, error) {
	switch e := C.ft_event_query(d.L, C.uintptr_t(ev)); e {
	case 0:
		return true, nil
	case cudaErrorNotReady:
		return false, nil
	default:
		return false, d.cudaErr("cudaEventQuery", e)
	}
}

func (d *dlLibrary) EventElapsed(start, end libapi.Event) (float32, error) {
	var ms C.float
	if err := d.cudaErr("cudaEventElapsedTime", C.ft_event_elapsed(d.L, C.uintptr_t(start), C.uintptr_t(end), &ms)); err != nil {
		return 0, err
	}
	return float32(ms), nil
}
