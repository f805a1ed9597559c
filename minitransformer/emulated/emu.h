// Just enough of CUDA to run csrc/'s kernels on the CPU, so that their indexing, masking,
// synchronisation and arithmetic can be tested on a machine without a GPU.
//
// Force-included (g++ -include emu.h) ahead of the kernel sources, which the build copies after
// textual rewrites: `kernel<<<grid, block, smem, stream>>>(args)` becomes
// `mt_emu::launch(kernel, grid, block, smem, stream)(args)`, the dynamic shared-memory
// declaration becomes a pointer to the launch's buffer, a static `__shared__ T name[N];`
// becomes a reference to a StaticShared array, and <cuda_pipeline.h> is replaced by the
// cp.async below.
//
// Model: blocks run one after another, in an order shuffled from launch to launch and never in
// index order (block_order; a GPU promises none). The threads of a block are fibers on the
// launching OS thread, each on a stack of its own, one running until it waits at a barrier or
// a warp collective that the others have not reached (Scheduler); under ThreadSanitizer each
// is also a TSan fiber, new for every block, so that TSan sees them as threads of their own.
//   __syncthreads        an OrderedBarrier over the block's threads: whatever any of them did
//                        before it happens before whatever any does after it; threads that
//                        all wait at barriers none of them can pass (one that some never
//                        reach) abort as a deadlock
//   warp collectives     __shfl_*_sync, mma.sync, ldmatrix: every lane posts its registers in
//                        the warp's slots, the lanes meet, each reads what it needs. They
//                        exchange registers and order no memory, as on the GPU (where only
//                        barriers and fences do)
//   shared memory        dynamic: one heap buffer per launch, which the kernels carve into
//                        arrays (SmemCarver): each lies in it with a gap after it that belongs
//                        to no array, and carving past the launch's size aborts, as does a
//                        launch asking for more than its blocks carve, or for more than
//                        48 KiB without cudaFuncSetAttribute's opt-in (as the GPU refuses
//                        it); static: one heap array per declaration (and template
//                        instantiation); under TSan
//                        new ones for every block. All are filled with poison at the start of
//                        every block, 0xFF bytes (a NaN in every float type) and 0x7B bytes (a
//                        large finite number in each) in turn, so that a read of shared memory
//                        the block has not written, or past a carved array's end, shows up in
//                        the results (compute-sanitizer's initcheck); a write into a gap
//                        aborts when the block ends (SharedMemory)
//   atomicAdd            a relaxed atomic addition: atomic, and ordering nothing else
//   ldmatrix.x4.trans    every lane posts its row address; each reads its column pairs
//   mma.sync m16n8k16    every lane posts its registers; each gathers the rows of A and the
//                        columns of B that its four outputs need, by the PTX ISA's fragment
//                        layout, and computes them in float32 (the tensor cores' products of
//                        16-bit inputs are exact, and they accumulate in float32 too)
//   cp.async             in flight until the __pipeline_wait_prior that covers its group: the
//                        source is read when the copy is issued, the destination holds poison
//                        until the wait, and a group no wait covers never lands, so a missing
//                        or too weak wait turns the results into NaN
//   misaligned cp.async or ldmatrix addresses abort, as the hardware faults on them.
// Functions map to the C library's (more exact than the GPU's approximate exp).
//
// The compilers' sanitizers (the build's `sanitize` variants) check the kernels in this model:
//   AddressSanitizer     accesses past the end of a global buffer (which the caller allocates
//                        exactly), of a static shared array (on the heap, exactly sized, with
//                        redzones around it), or of an array carved from dynamic shared memory
//                        (into its gap, which is poisoned), reported as they happen; with
//                        UndefinedBehaviorSanitizer, misaligned typed accesses (a uint4 load
//                        from an address not 16-byte aligned), indices past fixed-size arrays,
//                        signed overflow, bad shifts.
//   ThreadSanitizer      races between the threads of a block, and between blocks: two
//                        accesses to one location, one a write, with no barrier between them,
//                        in shared or global memory, also between lanes of a warp. TSan must
//                        see no order where the GPU has none: the emulator's own locking and
//                        slots are hidden from it (Unobserved), the order a barrier does
//                        create is told to it by a release and an acquire (publish,
//                        subscribe), and each block's threads are fibers that know nothing of
//                        the blocks before them, with shared memory of their own (Scheduler).
// Without a sanitizer, the shuffled order shows a block reading what another block writes in
// the same launch: the read finds the caller's poison, or the previous launch's values.
// What they cannot see: races between blocks more than kMaxFibers threads apart in a launch's
// order (TSan's limit on threads); overruns that land in other valid memory (from one row of
// a tile into the next within one array, from one row of a global tensor into the next, or
// farther past a carved array than its own length); races and reads of unwritten memory on
// paths that the shapes run do not reach; a read of poison that the kernel then drops (a branch
// not taken, a multiplication by zero). A block's fibers take turns in one fixed order (thread
// index, round and round), so a race between warps that this order happens to run the right
// way round shows only under TSan, which judges by the order barriers make, not by the turns. Streams, events and NCCL are the emulated
// CuPy's (minitransformer/emulated/cupy.py), not this file's.
#pragma once

// The count variant (emulator.py's "count") is compiled with -fsanitize=kernel-address, which
// only calls a function before every load and store; those functions count (Counting, below).
// No AddressSanitizer runtime, no shadow memory, nothing checked: so not MT_EMU_ASAN.
#if defined(__SANITIZE_ADDRESS__) && !defined(MT_EMU_COUNT)
#define MT_EMU_ASAN 1
#else
#define MT_EMU_ASAN 0
#endif

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <sys/mman.h>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if MT_EMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#ifdef __SANITIZE_THREAD__  // the ThreadSanitizer runtime's annotation interface
extern "C" {
void __tsan_acquire(void* address);
void __tsan_release(void* address);
void AnnotateIgnoreReadsBegin(const char* file, int line);
void AnnotateIgnoreReadsEnd(const char* file, int line);
void AnnotateIgnoreWritesBegin(const char* file, int line);
void AnnotateIgnoreWritesEnd(const char* file, int line);
void AnnotateIgnoreSyncBegin(const char* file, int line);
void AnnotateIgnoreSyncEnd(const char* file, int line);
void* __tsan_get_current_fiber();
void* __tsan_create_fiber(unsigned flags);
void __tsan_destroy_fiber(void* fiber);
void __tsan_switch_to_fiber(void* fiber, unsigned flags);
void __tsan_func_exit();
}
#endif

namespace mt_emu {

// ---------------------------------------------------------------------------- TSan's view

#ifdef __SANITIZE_THREAD__
// While one lives, TSan neither checks this thread's memory accesses nor takes its locks as
// ordering anything: for the emulator's bookkeeping, which is no part of the kernel.
struct Unobserved {
    Unobserved() {
        AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
        AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
        AnnotateIgnoreSyncBegin(__FILE__, __LINE__);
    }
    ~Unobserved() {
        AnnotateIgnoreSyncEnd(__FILE__, __LINE__);
        AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
        AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
    }
};
// publish(a) then subscribe(a) in another thread: what the first did before publishing happens
// before what the second does after subscribing.
inline void publish(void* address) { __tsan_release(address); }
inline void subscribe(void* address) { __tsan_acquire(address); }
#elif defined(MT_EMU_COUNT)
// In the count variant, the emulator's own accesses are not the kernel's: they pause Counting.
inline int counting_paused = 0;
struct Unobserved {
    Unobserved() { ++counting_paused; }
    ~Unobserved() { --counting_paused; }
    Unobserved(const Unobserved&) = delete;
    Unobserved& operator=(const Unobserved&) = delete;
};
inline void publish(void*) {}
inline void subscribe(void*) {}
#else
struct Unobserved {
    Unobserved() {}
};
inline void publish(void*) {}
inline void subscribe(void*) {}
#endif

// The scheduler's and the barriers' own state, which every fiber of a block touches: hidden
// from TSan, whose view must hold the kernel's accesses alone; the count variant counts no
// access to it anyway (it is no device memory), so it stays as it is there.
#ifdef __SANITIZE_THREAD__
using SchedulerState = Unobserved;
#else
struct SchedulerState {
    SchedulerState() {}
};
#endif

// The count variant closes a warp's requests where its lanes meet (Counting, below): the first
// thread out of a meeting closes those of the meeting's warp (-1: of every warp).
#ifdef MT_EMU_COUNT
inline void close_requests(int warp);
inline void count_meeting(unsigned& closed, unsigned phase, int warp) {
    if (closed != phase) {
        closed = phase;
        close_requests(warp);
    }
}
#define MT_EMU_COUNT_MEETING(closed, phase, warp) count_meeting(closed, phase, warp)
#else
#define MT_EMU_COUNT_MEETING(closed, phase, warp)
#endif

// ---------------------------------------------------------------------------- barriers

// Every CUDA thread of a block is a fiber on the launching OS thread (Scheduler below), and a
// barrier is a count: a thread that arrives before the others yields to the next fiber until
// the last one arrives. Under TSan the count is Unobserved: meeting here orders no memory in
// TSan's eyes (OrderedBarrier below tells it the order a barrier makes).
inline void yield_to_other_threads();
inline void note_progress();

class Barrier {
  public:
    explicit Barrier(int threads) : expected_(threads) {}

    // The phase that the caller's next arrival belongs to (it cannot end before then).
    unsigned phase() const {
        const SchedulerState hidden;
        return phase_;
    }

    void arrive_and_wait() {
        const SchedulerState hidden;
        const unsigned phase = phase_;
        note_progress();
        if (++arrived_ == expected_) {
            complete();
            return;
        }
        while (phase_ == phase) yield_to_other_threads();
    }

    // An exited thread: it is not waited for again.
    void arrive_and_drop() {
        const SchedulerState hidden;
        note_progress();
        if (--expected_ > 0 && arrived_ == expected_) complete();
    }

  private:
    void complete() {
        arrived_ = 0;
        ++phase_;
    }
    int expected_, arrived_ = 0;
    unsigned phase_ = 0;
};

// A barrier that orders memory: whatever a thread did before arriving happens before whatever
// any of them does after leaving (__syncthreads, and the boundaries between blocks). TSan
// learns it from a release and an acquire on published[phase % 2]: a thread that runs ahead
// into the next phase publishes to the other byte, which a slow thread still leaving this
// phase does not acquire (that would hide races between the two).
class OrderedBarrier {
  public:
    explicit OrderedBarrier(int threads) : barrier_(threads) {}

    void arrive_and_wait() {
        char* phase = &published_[barrier_.phase() % 2];
        publish(phase);
        barrier_.arrive_and_wait();
        subscribe(phase);
        MT_EMU_COUNT_MEETING(closed_, barrier_.phase(), -1);
    }

    // What an exited thread wrote is visible after the phase it leaves in.
    void arrive_and_drop() {
        publish(&published_[barrier_.phase() % 2]);
        barrier_.arrive_and_drop();
    }

  private:
    Barrier barrier_;
    char published_[2];
    unsigned closed_ = 0;  // the last phase whose requests are counted
};

// Warp collectives exchange registers through slots: a lane posts its values to slots[k % 2]
// for its k-th collective, the lanes meet, each reads what it needs. Alternating two sets
// makes one meeting per collective enough: a lane posts to a set again only after the next
// meeting, which every lane reaches after its reads.
struct Warp {
    Warp(int index, int lanes) : index(index), barrier(lanes) {}
    int index;  // in its block
    Barrier barrier;
    unsigned closed = 0;  // the last meeting whose requests are counted
    struct Slots {
        float value[32];
        uint32_t mma_a[32][4], mma_b[32][2];
        const void* row[32];
    } slots[2];
};

// A block's barriers, new for every block (exited threads drop out of them).
struct Block {
    explicit Block(int threads) : barrier(threads) {
        for (int w = 0; w < (threads + 31) / 32; ++w)
            warps.push_back(std::make_unique<Warp>(w, std::min(32, threads - 32 * w)));
    }
    OrderedBarrier barrier;
    std::vector<std::unique_ptr<Warp>> warps;
};

class SharedMemory;
struct AsyncCopies;

struct ThreadState {
    uint3 thread, block_index;
    dim3 block_dim, grid_dim;
    Block* block;
    Warp* warp;
    SharedMemory* shared;
    AsyncCopies* copies;  // its cp.async in flight
};
// The running CUDA thread's view, set as each fiber resumes: one for the process (launches take
// turns, on the OS thread that makes each, launch_lock).
inline ThreadState ts;

inline int lane() { return int(ts.thread.x % 32); }

// ---------------------------------------------------------------------------- shared memory

// Every block starts with its shared memory full of one poison byte, which alternates from one
// block to the next: 0xFF, NaN as float32, float16 and bfloat16 alike, so that reading what the
// block never wrote poisons the results; and 0x7B, a large finite number in each (about 1.3e36
// as float32 and bfloat16, 61280 as float16), which the reads that drop a NaN do not drop: a
// fmaxf(x, NaN) is x, a fmaxf(x, 1.3e36) is not.
constexpr unsigned char kNaNPoison = 0xFF, kFinitePoison = 0x7B;

inline unsigned char next_poison() {
    static std::atomic<unsigned> blocks{0};
    return blocks.fetch_add(1, std::memory_order_relaxed) % 2 ? kFinitePoison : kNaNPoison;
}

// Shared memory on the heap, 128-byte aligned as the kernels' carving assumes, exactly sized
// (so that ASan flags the first byte past it).
inline void* new_shared(size_t bytes) {
    void* p = nullptr;
    if (posix_memalign(&p, 128, bytes) != 0) throw std::bad_alloc();
    return p;
}

// The static __shared__ arrays of every kernel in the module, registered as the module loads:
// where each one's storage is, and its size.
struct StaticArray {
    void** storage;
    size_t bytes;
};

inline std::vector<StaticArray>& static_shared_arrays() {
    static std::vector<StaticArray> arrays;
    return arrays;
}

inline void* register_static_shared(void** storage, size_t bytes) {
    static_shared_arrays().push_back({storage, bytes});
    return new_shared(bytes);
}

// The storage of one static __shared__ declaration, allocated and registered as the module
// loads. On the heap, so that ASan has redzones around it (it gives none to the globals of
// templates, which the linker merges). Site, a local class at the declaration, makes each
// declaration (in each template instantiation) its own array; blocks run one at a time, so
// one array serves them all (under TSan, a new one for every block: SharedMemory::renew).
template <typename Site, typename Array>
struct StaticShared {
    static inline void* storage = register_static_shared(&StaticShared::storage, sizeof(Array));
    static Array& array() { return *static_cast<Array*>(storage); }
};

// A launch's shared memory: its dynamic buffer and the static arrays.
//
// The kernels carve the dynamic buffer into arrays (SmemCarver, which calls carve_shared
// here), and each array gets bounds of its own: the array at offset o of a kernel's layout lies
// at 2 o of a buffer twice the launch's size, so that after each one lies a gap at least as long
// as itself, which belongs to no array. Under ASan the gaps are poisoned (every access to them
// is reported at once); otherwise they hold poison, which a read past an array's end turns into
// NaN, and a write there is found when the block ends (check_gaps).
class SharedMemory {
  public:
    explicit SharedMemory(size_t bytes) : bytes_(bytes) {}
    ~SharedMemory() {
        check_gaps();
        check_extent();
        release(dynamic_);
    }
    SharedMemory(const SharedMemory&) = delete;
    SharedMemory& operator=(const SharedMemory&) = delete;

    unsigned char* dynamic() const { return dynamic_; }
    unsigned char poison() const { return poison_; }  // this block's

    // Where `p` lies as the kernel sees shared memory, or false outside every array: a carved
    // array's bytes at their offset in the layout; static array i's at (i + 1) << 32 on (each
    // array 128-byte aligned, so that banks are as on the GPU, whatever their order there).
    bool layout_address(uintptr_t p, uintptr_t& out) const {
        const auto& arrays = static_shared_arrays();
        for (size_t i = 0; i < arrays.size(); ++i) {
            const auto start = reinterpret_cast<uintptr_t>(*arrays[i].storage);
            if (p - start < arrays[i].bytes) {
                out = ((i + 1) << 32) + (p - start);
                return true;
            }
        }
        const uintptr_t b = p - reinterpret_cast<uintptr_t>(dynamic_);
        if (!dynamic_ || b >= 2 * bytes_) return false;
        auto array = carved_.upper_bound(b / 2);  // the last array at 2 o <= b
        if (array == carved_.begin()) return false;
        --array;
        const auto& [offset, bytes] = *array;
        if (b - 2 * offset >= bytes) return false;  // in the gap after it
        out = b - offset;
        return true;
    }

    // The array of `bytes` at `offset` of the kernel's layout; every thread of a block carves
    // the same arrays, the first to ask opens it.
    void* carve(size_t offset, size_t bytes) {
        Unobserved hidden;
        if (offset + bytes > bytes_) {
            std::fprintf(stderr, "a kernel carves bytes [%zu, %zu) of dynamic shared memory, but its "
                         "launch asked for %zu\n", offset, offset + bytes, bytes_);
            std::abort();
        }
        unsigned char* array = dynamic_ + 2 * offset;
        std::lock_guard lock(mutex_);
        if (carved_.emplace(offset, bytes).second) {
#if MT_EMU_ASAN
            ASAN_UNPOISON_MEMORY_REGION(array, bytes);
#endif
        }
        return array;
    }

    // A block's shared memory, new: poisoned, and under TSan newly allocated (the old memory
    // freed out of its sight), so that no access of one block meets another's, as on the GPU
    // where each block has shared memory of its own. The block before is checked first.
    void renew() {
        check_gaps();
        check_extent();
        carved_.clear();
        poison_ = next_poison();
#ifdef __SANITIZE_THREAD__
        unsigned char* fresh = allocate();
        {
            Unobserved hidden;
            std::free(dynamic_);
            dynamic_ = fresh;
        }
        for (const StaticArray& a : static_shared_arrays()) {
            void* array = new_shared(a.bytes);
            Unobserved hidden;
            std::free(*a.storage);
            *a.storage = array;
        }
#else
        if (!dynamic_) dynamic_ = allocate();
#endif
        if (dynamic_) {
#if MT_EMU_ASAN
            ASAN_UNPOISON_MEMORY_REGION(dynamic_, 2 * bytes_);
#endif
            std::memset(dynamic_, poison_, 2 * bytes_);
#if MT_EMU_ASAN
            ASAN_POISON_MEMORY_REGION(dynamic_, 2 * bytes_);  // until carved
#endif
        }
        for (const StaticArray& a : static_shared_arrays()) {
            void* array;
            {
                Unobserved hidden;
                array = *a.storage;
            }
            std::memset(array, poison_, a.bytes);
        }
    }

  private:
    unsigned char* allocate() const {
        return bytes_ ? static_cast<unsigned char*>(new_shared(2 * bytes_)) : nullptr;
    }

    void release(unsigned char* buffer) const {
#if MT_EMU_ASAN
        if (buffer) ASAN_UNPOISON_MEMORY_REGION(buffer, 2 * bytes_);
#endif
        std::free(buffer);
    }

    // A write outside the arrays the block carved (under ASan reported as it happened).
    void check_gaps() const {
#if !MT_EMU_ASAN
        Unobserved hidden;
        size_t from = 0;  // the first byte of the current gap, and the array before it
        std::pair<size_t, size_t> before{0, 0};
        auto check = [&](size_t to) {
            for (size_t i = from; i < to; ++i)
                if (dynamic_[i] != poison_) {
                    std::fprintf(stderr, "a block wrote dynamic shared memory outside the arrays it "
                                 "carved: %zu bytes past the end of the array of %zu bytes at "
                                 "offset %zu of its layout\n", i - 2 * before.first - before.second,
                                 before.second, before.first);
                    std::abort();
                }
        };
        for (const auto& [offset, bytes] : carved_) {
            check(2 * offset);
            from = 2 * offset + bytes;
            before = {offset, bytes};
        }
        if (dynamic_) check(2 * bytes_);
#endif
    }

    // A launch asks for no more than its blocks carve: the end of the last array, at most
    // rounded up to 128 bytes as SmemCarver rounds each one. More is shared memory no array
    // uses, which on the GPU only lowers how many blocks fit on a multiprocessor.
    void check_extent() const {
        Unobserved hidden;
        if (carved_.empty()) return;  // a block that returned before carving
        const auto& [offset, bytes] = *carved_.rbegin();
        const size_t extent = (offset + bytes + 127) / 128 * 128;
        if (bytes_ > extent) {
            std::fprintf(stderr, "a launch asked for %zu bytes of dynamic shared memory, but its blocks "
                         "carve %zu\n", bytes_, offset + bytes);
            std::abort();
        }
    }

    unsigned char* dynamic_ = nullptr;
    size_t bytes_;
    unsigned char poison_ = kNaNPoison;
    std::mutex mutex_;
    std::map<size_t, size_t> carved_;  // offset in the kernel's layout -> bytes
};

inline unsigned char* dynamic_smem() { return ts.shared->dynamic(); }
inline void* carve_shared(size_t offset, size_t bytes) { return ts.shared->carve(offset, bytes); }
#define MT_EMULATED_SMEM 1

// ---------------------------------------------------------------------------- counting

#ifdef MT_EMU_COUNT
// What a launch will cost in memory traffic, read off the addresses its threads touch (what
// Nsight Compute counts on a GPU). In the count variant, -fsanitize=kernel-address calls
// count_access before every load and store, and the primitives below (ldmatrix, mma.sync,
// cp.async, __syncthreads, atomicAdd) count themselves. An access counts where it lands in
// global memory (the arrays registered by mt_emu_count_global: the emulated CuPy's) or in a
// shared array; what spills to a thread's stack, and the emulator's own accesses (Unobserved),
// do not.
//
// A request is one instruction of a warp, its lanes' accesses together. Here the lanes run one
// after another, so the k-th access that each lane makes at one program point (the return
// address of the call that counts it) and of one kind makes the k-th request there; a warp's
// requests close where its lanes meet (a collective, a barrier, the block's end), by when each
// lane has made its accesses. Lanes that branched away leave requests of fewer lanes, as on
// the GPU. What a request costs:
//   global memory  its 32-byte sectors, counted from its array's start as if that were
//                  256-byte aligned (as cudaMalloc's are; NumPy's buffers are 16-byte aligned);
//                  ideally its distinct bytes / 32, rounded up
//   shared memory  its wavefronts: lanes in phases of 128 bytes (32 lanes of 4-byte accesses,
//                  16 of 8, 8 of 16, as ldmatrix's rows), each phase as many as its busiest
//                  bank has distinct 4-byte words (one word read by many lanes is one
//                  broadcast); ideally one a phase, and each one more is a bank conflict
//   barriers, mma  one per warp
// At the width the source states (the variant builds with -O1, which does not vectorise):
// nvcc may merge or split accesses that g++ keeps, which the first GPU run compares.
enum CountKind : unsigned {
    kGlobalLoad, kGlobalStore, kGlobalAtomic, kCpAsyncRead,  // in global memory
    kSharedLoad, kSharedStore, kLdmatrix, kCpAsyncWrite,     // in shared memory
    kBarrier, kMma, kCountKinds
};

struct Counting {
    struct Access {
        unsigned lane;
        uintptr_t address;  // global: from its array's start, aligned as above; shared: layout_address
        unsigned size;
    };
    using Point = std::pair<uintptr_t, unsigned>;  // (return address, kind)
    struct Warp {
        std::map<std::pair<unsigned, Point>, unsigned> made;               // (lane, point) -> accesses
        std::map<std::pair<Point, unsigned>, std::vector<Access>> requests;  // (point, k) -> accesses
    };
    struct Total {
        unsigned long long requests = 0, accesses = 0, bytes = 0, units = 0, ideal = 0;
    };

    bool on = false;       // mt_emu_log_launches
    bool running = false;  // a CUDA thread, not the scheduler between them
    size_t launch = 0;     // its index in the launch log
    std::map<uintptr_t, size_t> globals;  // the arrays of global memory: start -> bytes
    std::vector<Warp> warps;              // the running block's
    std::map<Point, Total> totals;        // the running launch's
    // launch, kind, return address, requests, accesses, bytes, sectors or wavefronts, ideally
    std::vector<std::array<unsigned long long, 8>> records;
};
inline Counting counting_state;

// The distinct bytes of a request's accesses.
inline unsigned long long distinct_bytes(std::vector<Counting::Access> accesses) {
    std::sort(accesses.begin(), accesses.end(),
              [](const auto& a, const auto& b) { return a.address < b.address; });
    unsigned long long bytes = 0;
    uintptr_t end = 0;
    for (const auto& a : accesses) {
        const uintptr_t from = std::max(a.address, end), to = a.address + a.size;
        if (to > from) bytes += to - from;
        end = std::max(end, to);
    }
    return bytes;
}

// A request's (sectors or wavefronts, the ideal number of them).
inline std::pair<unsigned long long, unsigned long long> request_cost(unsigned kind,
                                                                       const std::vector<Counting::Access>& accesses) {
    if (kind >= kBarrier) return {1, 1};
    if (kind <= kCpAsyncRead) {
        std::vector<uintptr_t> sectors;
        for (const auto& a : accesses)
            for (uintptr_t s = a.address / 32; s <= (a.address + a.size - 1) / 32; ++s) sectors.push_back(s);
        std::sort(sectors.begin(), sectors.end());
        const auto n = std::unique(sectors.begin(), sectors.end()) - sectors.begin();
        return {n, (distinct_bytes(accesses) + 31) / 32};
    }
    unsigned width = 4;
    for (const auto& a : accesses) width = std::max(width, a.size);
    const unsigned lanes_per_phase = std::max(1u, std::min(32u, 128u / width));
    std::map<unsigned, std::map<uintptr_t, std::vector<uintptr_t>>> phases;  // phase -> bank -> words
    for (const auto& a : accesses)
        for (uintptr_t w = a.address / 4; w <= (a.address + a.size - 1) / 4; ++w)
            phases[a.lane / lanes_per_phase][w % 32].push_back(w);
    unsigned long long wavefronts = 0;
    for (auto& [phase, banks] : phases) {
        size_t busiest = 0;
        for (auto& [bank, words] : banks) {
            std::sort(words.begin(), words.end());
            busiest = std::max<size_t>(busiest, std::unique(words.begin(), words.end()) - words.begin());
        }
        wavefronts += busiest;
    }
    return {wavefronts, phases.size()};
}

// Close the requests of warp `warp` of the running block (-1: of every warp) into the totals.
inline void close_requests(int warp) {
    Unobserved hidden;
    Counting& c = counting_state;
    for (size_t w = 0; w < c.warps.size(); ++w) {
        if (warp >= 0 && size_t(warp) != w) continue;
        for (const auto& [key, accesses] : c.warps[w].requests) {
            const auto [units, ideal] = request_cost(key.first.second, accesses);
            Counting::Total& t = c.totals[key.first];
            t.requests += 1;
            t.accesses += accesses.size();
            for (const auto& a : accesses) t.bytes += a.size;
            t.units += units;
            t.ideal += ideal;
        }
        c.warps[w].requests.clear();
        c.warps[w].made.clear();
    }
}

// One access of the running CUDA thread, at `address` as Counting::Access holds it.
inline void count_at(unsigned kind, uintptr_t address, unsigned size, uintptr_t pc) {
    Counting& c = counting_state;
    const unsigned thread = ts.thread.x, lane = thread % 32;
    Counting::Warp& warp = c.warps.at(thread / 32);
    const Counting::Point point{pc, kind};
    const unsigned k = warp.made[{lane, point}]++;
    warp.requests[{point, k}].push_back({lane, address, size});
}

inline bool counting_now() {
    const Counting& c = counting_state;
    return c.on && c.running && !counting_paused;
}

// One access of `kind` at `p` (dropped where it lies outside the kind's memory), or an event.
inline void count(unsigned kind, uintptr_t p, unsigned size, uintptr_t pc) {
    if (!counting_now()) return;
    Unobserved hidden;
    uintptr_t address = 0;
    if (kind <= kCpAsyncRead) {
        const auto& globals = counting_state.globals;
        auto array = globals.upper_bound(p);
        if (array == globals.begin()) return;
        --array;
        if (p - array->first >= array->second) return;
        address = p - array->first % 256;
    } else if (kind <= kCpAsyncWrite && !ts.shared->layout_address(p, address)) {
        return;
    }
    count_at(kind, address, size, pc);
}

// A load or store that the compiler instrumented: shared, global, or neither.
[[gnu::no_sanitize_address]] inline void count_access(uintptr_t p, unsigned size, bool store, uintptr_t pc) {
    if (!counting_now()) return;
    uintptr_t address;
    bool shared;
    {
        Unobserved hidden;
        shared = ts.shared->layout_address(p, address);
    }
    if (!shared) return count(store ? kGlobalStore : kGlobalLoad, p, size, pc);
    Unobserved hidden;
    count_at(store ? kSharedStore : kSharedLoad, address, size, pc);
}

inline void count_running(bool running) { counting_state.running = running; }

inline void count_block(int threads) {  // a block begins (threads > 0) or ends (0)
    Counting& c = counting_state;
    if (!c.on) return;
    Unobserved hidden;
    if (threads == 0) close_requests(-1);
    c.warps.assign((threads + 31) / 32, {});
}

inline void count_launch() {  // its blocks have run: its totals become records
    Counting& c = counting_state;
    if (!c.on) return;
    Unobserved hidden;
    for (const auto& [point, t] : c.totals)
        c.records.push_back({c.launch, point.second, point.first, t.requests, t.accesses, t.bytes, t.units, t.ideal});
    c.totals.clear();
}
#define MT_EMU_COUNTED [[gnu::noinline]]  // so that its return address is its call site's
#define MT_EMU_COUNT_HERE(kind, p, size) \
    mt_emu::count(mt_emu::kind, uintptr_t(p), size, uintptr_t(__builtin_return_address(0)))
#else
inline void count_running(bool) {}
inline void count_block(int) {}
inline void count_launch() {}
#define MT_EMU_COUNTED
#define MT_EMU_COUNT_HERE(kind, p, size)
#endif

// ---------------------------------------------------------------------------- cp.async

// A thread's copies in flight, oldest first, and how many of them each committed group holds
// (oldest first; copies past the groups are issued but not yet committed). Bookkeeping of the
// emulator, so unobserved; what a copy reads and writes is the thread's own, and checked.
struct AsyncCopy {
    void* dst;
    unsigned size;
    unsigned char bytes[16];
};
struct AsyncCopies {
    std::deque<AsyncCopy> copies;
    std::deque<size_t> groups;
};

// What a thread left in flight when its block ended never lands.
inline void forget_async_copies() {
    Unobserved hidden;
    ts.copies->copies.clear();
    ts.copies->groups.clear();
}

inline void issue_async_copy(void* dst, const void* src, size_t size, size_t zfill) {
    if (size > sizeof(AsyncCopy::bytes)) {
        std::fprintf(stderr, "cp.async of %zu bytes: 4, 8 or 16 only\n", size);
        std::abort();
    }
    unsigned char staged[sizeof(AsyncCopy::bytes)];
    std::memcpy(staged, src, size - zfill);
    std::memset(staged + size - zfill, 0, zfill);
    unsigned char poison;
    {
        Unobserved hidden;
        poison = ts.shared->poison();
    }
    std::memset(dst, poison, size);  // in flight: the destination is not yet the data
    Unobserved hidden;
    AsyncCopy& copy = ts.copies->copies.emplace_back(AsyncCopy{dst, unsigned(size), {}});
    std::memcpy(copy.bytes, staged, size);
}

inline void commit_async_copies() {
    Unobserved hidden;
    size_t grouped = 0;
    for (size_t n : ts.copies->groups) grouped += n;
    ts.copies->groups.push_back(ts.copies->copies.size() - grouped);
}

// __pipeline_wait_prior(pending): every committed group but the newest `pending` lands.
inline void land_async_copies(size_t pending) {
    while (true) {
        AsyncCopy copy;
        {
            Unobserved hidden;
            AsyncCopies& q = *ts.copies;
            if (q.groups.size() <= pending) return;
            if (q.groups.front() == 0) {
                q.groups.pop_front();
                continue;
            }
            --q.groups.front();
            copy = q.copies.front();
            q.copies.pop_front();
        }
        unsigned char staged[sizeof(AsyncCopy::bytes)];
        {
            Unobserved hidden;
            std::memcpy(staged, copy.bytes, copy.size);
        }
        std::memcpy(copy.dst, staged, copy.size);
    }
}

// ---------------------------------------------------------------------------- block order

// A GPU runs the blocks of a launch in no promised order. Here they run one after another, in
// an order shuffled from launch to launch and never in index order (two blocks or more), so
// that a kernel counting on one block finishing before another fails. The order follows from
// the process's seed (MT_EMU_BLOCK_SEED, else random) and the launch's number since the last
// restart: the same seed replays the same orders (mt_emu_block_seed, mt_emu_restart_block_order).
struct BlockOrder {
    uint64_t seed;
    std::atomic<uint64_t> launches{0};
};

inline uint64_t initial_block_seed() {
    if (const char* env = std::getenv("MT_EMU_BLOCK_SEED")) return std::strtoull(env, nullptr, 0);
    return (uint64_t(std::random_device{}()) << 32) ^ std::random_device{}();
}

inline BlockOrder& block_order_state() {
    static BlockOrder state{initial_block_seed()};
    return state;
}

inline std::vector<unsigned> block_order(unsigned blocks) {
    BlockOrder& state = block_order_state();
    std::mt19937_64 rng(state.seed ^ (0x9E3779B97F4A7C15ull * ++state.launches));
    std::vector<unsigned> order(blocks);
    std::iota(order.begin(), order.end(), 0u);
    std::shuffle(order.begin(), order.end(), rng);
    if (std::is_sorted(order.begin(), order.end())) std::reverse(order.begin(), order.end());
    return order;
}

// ---------------------------------------------------------------------------- launches

// Saves the caller's callee-saved registers on its stack and its stack pointer in *save, then
// continues on the stack at `next` (as left by an earlier call, or as Scheduler prepares a new
// one), popping its registers. What the System V x86-64 ABI leaves to the callee is all a
// switch must keep; swapcontext also switches the signal mask, a system call each time.
[[gnu::naked, gnu::noinline]] inline void switch_stack(void** /*save*/, void* /*next*/) {
    asm volatile(
        "pushq %rbp\n pushq %rbx\n pushq %r12\n pushq %r13\n pushq %r14\n pushq %r15\n"
        "movq %rsp, (%rdi)\n movq %rsi, %rsp\n"
        "popq %r15\n popq %r14\n popq %r13\n popq %r12\n popq %rbx\n popq %rbp\n ret\n");
}

// The CUDA threads of a block are fibers on the launching OS thread, each on a stack of its
// own: one runs until it must wait (at a barrier or a warp collective that others have not
// reached), then the next one does. No OS thread per CUDA thread, no locking, no scheduling by
// the OS (with a hundred OS threads per block on two cores, each barrier cost milliseconds of
// waking and spinning, under TSan two thirds of its run in the kernel); a barrier costs one
// switch per thread. When every thread still running waits and none can go on, some never
// reach the barrier the others wait at (a __syncthreads in a branch that not all take): a
// deadlock on the GPU, an abort here.
//
// Under TSan each CUDA thread of a block is a TSan fiber that no thread of the blocks before it
// was, on a stack newly allocated (TSan forgets what freed memory saw), entered with all the
// launching thread knows (the arguments, the block's new shared memory) and left without
// telling it anything: so TSan sees no order between one block and another, as the GPU gives
// none, and within a block only the order that barriers tell it (OrderedBarrier). There are
// kMaxFibers of them (of the 8,128 threads TSan allows a process), taken in turn: a block's
// threads are ordered after those that were the same fibers kMaxFibers threads earlier, so
// races between blocks farther apart than that go unseen. (A fiber made anew for every thread
// of every block cost six times the whole run, and a destroyed one's identity would go to a
// later one all the same.)
class Scheduler {
  public:
    using Body = void (*)(const void* task, const ThreadState& state);

    Scheduler() = default;
    Scheduler(const Scheduler&) = delete;
    Scheduler& operator=(const Scheduler&) = delete;
    ~Scheduler() {
#ifdef __SANITIZE_THREAD__
        for (void* fiber : identities_) __tsan_destroy_fiber(fiber);
#else
        for (auto& f : fibers_) munmap(f->mapping, kGuard + kStack);
#endif
    }

    // One block: its threads' states (`first` with thread index t and warp t / 32), each
    // running body(task, state), until all have exited.
    void run_block(int threads, const ThreadState& first, Body body, const void* task) {
        {
            const SchedulerState hidden;
            while (int(fibers_.size()) < threads) fibers_.push_back(new_fiber());
            body_ = body;
            task_ = task;
#ifdef __SANITIZE_THREAD__
            main_fiber_ = __tsan_get_current_fiber();
#endif
            for (int t = 0; t < threads; ++t) {
                Fiber& f = *fibers_[t];
                f.state = first;
                f.state.thread = uint3{unsigned(t), 0, 0};
                f.state.warp = first.block->warps[t / 32].get();
                f.state.copies = &f.copies;
                f.done = false;
#ifdef __SANITIZE_THREAD__
                f.stack = static_cast<unsigned char*>(std::malloc(kStack));  // new to TSan, as the shared memory is
                if (!f.stack) throw std::bad_alloc();
                f.fiber = next_identity();
#endif
#if MT_EMU_ASAN
                // the poison of the frames that the stack's last fiber left (it never returned)
                ASAN_UNPOISON_MEMORY_REGION(f.stack + kStack - kUnpoison, kUnpoison);
#endif
                // A new stack as switch_stack leaves one: six registers (zero), then where to
                // return, entry, which is entered with the stack 16-byte aligned as a call leaves it.
                auto* top = reinterpret_cast<uintptr_t*>(f.stack + kStack);
                top[-1] = 0;
                top[-2] = reinterpret_cast<uintptr_t>(&entry);
                for (int r = 3; r <= 8; ++r) top[-r] = 0;
                f.sp = top - 8;
            }
        }
        int live = threads, idle = 0;
        for (int t = 0; live > 0; t = (t + 1) % threads) {
            Fiber& f = *fibers_[t];
            if (done(f)) continue;
            set_progress(false);
            resume(f);
            if (done(f)) --live;
            if (set_progress(false)) {
                idle = 0;
            } else if (++idle >= live) {
                std::fprintf(stderr, "deadlock in block (%u, %u, %u): each of its %d threads still "
                             "running waits at a barrier (__syncthreads or a warp collective) that "
                             "another never reaches\n", first.block_index.x, first.block_index.y,
                             first.block_index.z, live);
                std::abort();
            }
        }
#ifdef __SANITIZE_THREAD__
        const SchedulerState hidden;
        for (int t = 0; t < threads; ++t) std::free(fibers_[t]->stack);
#endif
    }

    // From the running fiber: let the others run; it resumes where it was.
    void yield() {
        Fiber& f = *current_;
        start_switch(&f.fake_stack, main_bottom_, main_size_);
        to_main();
        switch_stack(&f.sp, main_sp_);
        finish_switch(f.fake_stack);
    }

    // Something happened that may let a waiting thread go on (an arrival, an exit).
    void progress() { set_progress(true); }

  private:
#ifdef __SANITIZE_THREAD__
    // A kernel's stack, with room for TSan's reports (the attention cases ran clean in 16 KiB and
    // reported their planted races in 32). No larger: TSan clears the shadow of each fiber's
    // stack when it is freed, and at 256 KiB that was half of a run's time.
    static constexpr size_t kStack = 64 << 10, kMaxFibers = 6144;
#else
    static constexpr size_t kStack = 256 << 10, kGuard = 4096, kUnpoison = 64 << 10;
#endif

    struct Fiber {
        void* sp;  // where its stack was left
        ThreadState state;
        AsyncCopies copies;
        void* mapping;
        unsigned char* stack;
        bool done;
        void* fake_stack = nullptr;  // ASan's, for the frames of this fiber's stack
        void* fiber = nullptr;       // TSan's, for this block's thread
    };

    static std::unique_ptr<Fiber> new_fiber() {
        auto f = std::make_unique<Fiber>();
#ifndef __SANITIZE_THREAD__  // (under TSan, a stack of its own for every block)
        // A guard page below the stack: an overflow faults instead of writing the heap.
        void* m = mmap(nullptr, kGuard + kStack, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
        if (m == MAP_FAILED) throw std::bad_alloc();
        mprotect(m, kGuard, PROT_NONE);
        f->mapping = m;
        f->stack = static_cast<unsigned char*>(m) + kGuard;
#endif
        return f;
    }

    void resume(Fiber& f) {
        {
            const SchedulerState hidden;
            ts = f.state;
            current_ = &f;
        }
        start_switch(&main_fake_stack_, f.stack, kStack);
        count_running(true);
#ifdef __SANITIZE_THREAD__
        __tsan_switch_to_fiber(f.fiber, 0);  // what this thread did happens before what f does
#endif
        switch_stack(&main_sp_, f.sp);
        count_running(false);
        finish_switch(main_fake_stack_);
    }

    // From a fiber, just before its stack is left: back to the launching thread, which learns
    // nothing of what the fiber did.
    void to_main() {
#ifdef __SANITIZE_THREAD__
        __tsan_switch_to_fiber(main_fiber_, kNoSync);
#endif
    }

#ifdef __SANITIZE_THREAD__
    void* next_identity() {  // the TSan fiber whose turn it is, made on first use
        if (identities_.size() < kMaxFibers) return identities_.emplace_back(__tsan_create_fiber(0));
        void* fiber = identities_[turn_];
        turn_ = (turn_ + 1) % kMaxFibers;
        return fiber;
    }
#endif

    static bool done(const Fiber& f) {
        const SchedulerState hidden;
        return f.done;
    }

    bool set_progress(bool progress) {  // returns what it was
        const SchedulerState hidden;
        return std::exchange(progress_, progress);
    }

    static void entry();

    // AddressSanitizer's bookkeeping of a stack switch (a no-op without it).
    void start_switch(void** fake_stack, const void* bottom, size_t size) {
#if MT_EMU_ASAN
        __sanitizer_start_switch_fiber(fake_stack, bottom, size);
#endif
    }
    void finish_switch(void* fake_stack) {
#if MT_EMU_ASAN
        __sanitizer_finish_switch_fiber(fake_stack, &main_bottom_, &main_size_);
#endif
    }

#ifdef __SANITIZE_THREAD__
    static constexpr unsigned kNoSync = 1;  // __tsan_switch_to_fiber's flag
    void* main_fiber_ = nullptr;            // the launching thread's
    std::vector<void*> identities_;         // TSan's fibers, up to kMaxFibers
    size_t turn_ = 0;                       // the next one's, once all are made
#endif
    std::vector<std::unique_ptr<Fiber>> fibers_;  // reused from block to block
    Fiber* current_ = nullptr;
    void* main_sp_ = nullptr;  // the launching thread's stack, while a fiber runs
    void* main_fake_stack_ = nullptr;
    const void* main_bottom_ = nullptr;
    size_t main_size_ = 0;
    Body body_ = nullptr;
    const void* task_ = nullptr;
    bool progress_ = false;
};

// One scheduler, for one launch at a time: each runs on the OS thread that makes it, holding
// the lock, so that two host threads launching at once take turns.
inline Scheduler& scheduler() {
    static Scheduler one;
    return one;
}
inline std::mutex& launch_lock() {
    static std::mutex lock;
    return lock;
}

inline void Scheduler::entry() {
    Scheduler& s = scheduler();
    Fiber& f = *s.current_;
    s.finish_switch(nullptr);
    s.body_(s.task_, f.state);
    {
        const SchedulerState hidden;
        f.done = true;
    }
    s.start_switch(nullptr, s.main_bottom_, s.main_size_);  // this fiber's frames end here
#ifdef __SANITIZE_THREAD__
    __tsan_func_exit();  // and in TSan's stack of them, which the fiber keeps for its next block
#endif
    s.to_main();
    switch_stack(&f.sp, s.main_sp_);                        // never resumed
}

inline void yield_to_other_threads() { scheduler().yield(); }
inline void note_progress() { scheduler().progress(); }

// A kernel launch: the blocks one after another, in block_order, each from new shared memory.
template <typename... KArgs>
struct Launcher {
    void (*kernel)(KArgs...);
    dim3 grid, block;
    size_t smem;

    // One CUDA thread of one block, which publishes what it did at `launch_end` for the launching
    // thread, at the launch's end, to learn.
    template <typename Packed>
    static void run_thread(const Launcher& self, const Packed& packed, const ThreadState& state,
                           char* launch_end) {
        forget_async_copies();
        std::apply(self.kernel, packed);
        // An exited thread no longer holds up its block's or warp's barriers.
        state.block->barrier.arrive_and_drop();
        state.warp->barrier.arrive_and_drop();
        publish(launch_end);
    }

    template <typename... Args>
    void operator()(Args&&... args) const {
        using Packed = std::tuple<std::decay_t<KArgs>...>;
        const Packed packed(std::forward<Args>(args)...);
        const int threads = int(block.x * block.y * block.z);
        const std::vector<unsigned> order = block_order(grid.x * grid.y * grid.z);
        SharedMemory shared(smem);
        char launch_end = 0;
        struct Task {
            const Launcher* self;
            const Packed* packed;
            char* launch_end;
        } task{this, &packed, &launch_end};
        std::lock_guard turn(launch_lock());
        for (unsigned b : order) {
            shared.renew();
            // On the heap, new: TSan knows a barrier's order by its address, and the same one on
            // the stack would order each block after the block before.
            const auto state = std::make_unique<Block>(threads);
            count_block(threads);
            const uint3 index{b % grid.x, b / grid.x % grid.y, b / (grid.x * grid.y)};
            scheduler().run_block(threads, ThreadState{{}, index, block, grid, state.get(), nullptr, &shared, nullptr},
                                  [](const void* t, const ThreadState& st) {
                                      const Task& task = *static_cast<const Task*>(t);
                                      run_thread(*task.self, *task.packed, st, task.launch_end);
                                  },
                                  &task);
            count_block(0);
        }
        subscribe(&launch_end);  // what every block did, before the launch returns
        count_launch();
    }
};

// The GPU launches a kernel with more than 48 KiB of dynamic shared memory only after
// cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) opted it in
// for at least that much; so does the emulation.
constexpr size_t kDefaultDynamicSmem = 48 * 1024;

struct OptIns {
    std::mutex mutex;
    std::map<const void*, int> bytes;  // kernel -> the dynamic shared memory it may launch with
};
inline OptIns& opt_ins() {
    static OptIns one;
    return one;
}

inline cudaError_t func_set_attribute(const void* kernel, cudaFuncAttribute attribute, int value) {
    if (attribute == cudaFuncAttributeMaxDynamicSharedMemorySize) {
        std::lock_guard lock(opt_ins().mutex);
        opt_ins().bytes[kernel] = value;
    }
    return cudaSuccess;
}

// While on (mt_emu_log_launches), every launch's kernel, grid, block and dynamic shared memory,
// in order: which instantiation each launcher chose, and with how many threads
// (emulator.logged_launches reads them).
struct LaunchLog {
    std::mutex mutex;
    bool on = false;
    std::vector<std::array<unsigned long long, 8>> records;  // kernel, grid x y z, block x y z, smem
};
inline LaunchLog& launch_log() {
    static LaunchLog one;
    return one;
}

template <typename... KArgs>
Launcher<KArgs...> launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t) {
    {
        std::lock_guard lock(launch_log().mutex);
        if (launch_log().on) {
            launch_log().records.push_back({reinterpret_cast<uintptr_t>(kernel), grid.x, grid.y, grid.z,
                                            block.x, block.y, block.z, smem});
#ifdef MT_EMU_COUNT
            counting_state.launch = launch_log().records.size() - 1;
#endif
        }
    }
    if (smem > kDefaultDynamicSmem) {
        std::lock_guard lock(opt_ins().mutex);
        const auto granted = opt_ins().bytes.find(reinterpret_cast<const void*>(kernel));
        const int bytes = granted == opt_ins().bytes.end() ? 0 : granted->second;
        if (size_t(bytes) < smem) {
            std::fprintf(stderr, "a launch asks for %zu bytes of dynamic shared memory, over 48 KiB, but "
                         "cudaFuncSetAttribute opted its kernel in for %d: the GPU refuses it\n", smem, bytes);
            std::abort();
        }
    }
    return {kernel, grid, block, smem};
}

// The GPU faults on a misaligned address (cudaErrorMisalignedAddress); so does the emulation.
inline void require_aligned(const void* address, size_t alignment, const char* what) {
    if (uintptr_t(address) % alignment != 0) {
        std::fprintf(stderr, "%s address %p is not %zu-byte aligned\n", what, address, alignment);
        std::abort();
    }
}

// ---------------------------------------------------------------------------- warp collectives

// One collective of the calling lane: post(slots) writes its registers, the lanes meet,
// read(slots) reads theirs. The slots pass unobserved: registers are no shared memory.
template <typename Post, typename Read>
void warp_collective(Post&& post, Read&& read) {
    Warp& w = *ts.warp;
    Warp::Slots& slots = w.slots[w.barrier.phase() % 2];
    {
        Unobserved hidden;
        post(slots);
    }
    w.barrier.arrive_and_wait();
    MT_EMU_COUNT_MEETING(w.closed, w.barrier.phase(), w.index);
    Unobserved hidden;
    read(std::as_const(slots));
}

// Lane `src`'s v, for every lane.
inline float shuffle(float v, int src) {
    float r;
    warp_collective([&](Warp::Slots& s) { s.value[lane()] = v; },
                    [&](const Warp::Slots& s) { r = s.value[src]; });
    return r;
}

}  // namespace mt_emu

// For the tests: the seed of this process's block orders, and a restart of their sequence (the
// next launch is the first again), so that a test replays alone as it ran among others.
extern "C" __attribute__((used, visibility("default"))) inline unsigned long long mt_emu_block_seed() {
    return mt_emu::block_order_state().seed;
}
extern "C" __attribute__((used, visibility("default"))) inline void mt_emu_restart_block_order() {
    mt_emu::block_order_state().launches = 0;
}
// The launch log: turned on (and emptied) or off; its length; record i as 8 numbers. In the
// count variant, the launches logged are counted (mt_emu_count_records).
extern "C" __attribute__((used, visibility("default"))) inline void mt_emu_log_launches(int on) {
    std::lock_guard lock(mt_emu::launch_log().mutex);
    mt_emu::launch_log().on = on;
    if (on) mt_emu::launch_log().records.clear();
#ifdef MT_EMU_COUNT
    mt_emu::Unobserved hidden;
    mt_emu::counting_state.on = on;
    if (on) mt_emu::counting_state.records.clear();
#endif
}
extern "C" __attribute__((used, visibility("default"))) inline size_t mt_emu_launch_count() {
    std::lock_guard lock(mt_emu::launch_log().mutex);
    return mt_emu::launch_log().records.size();
}
extern "C" __attribute__((used, visibility("default"))) inline void mt_emu_launch_record(size_t i,
                                                                                      unsigned long long* out) {
    std::lock_guard lock(mt_emu::launch_log().mutex);
    std::copy_n(mt_emu::launch_log().records.at(i).begin(), 8, out);
}

#ifdef MT_EMU_COUNT
// The counters: whether this module counts; the arrays of global memory (bytes 0 forgets the
// one at `start`); the totals of each (launch, kind, program point), as 8 numbers each.
extern "C" __attribute__((used, visibility("default"))) inline int mt_emu_counts() { return 1; }
extern "C" __attribute__((used, visibility("default"))) inline void mt_emu_count_global(uintptr_t start, size_t bytes) {
    mt_emu::Unobserved hidden;
    if (bytes) mt_emu::counting_state.globals[start] = bytes;
    else mt_emu::counting_state.globals.erase(start);
}
extern "C" __attribute__((used, visibility("default"))) inline size_t mt_emu_count_records() {
    return mt_emu::counting_state.records.size();
}
extern "C" __attribute__((used, visibility("default"))) inline void mt_emu_count_record(size_t i, unsigned long long* out) {
    mt_emu::Unobserved hidden;
    std::copy_n(mt_emu::counting_state.records.at(i).begin(), 8, out);
}
// -fsanitize=kernel-address's calls before each load and store of N bytes: weak, for they are
// defined in every source that includes this file, and not inline, for the compiler's calls
// to them do not count as uses; hidden, so that each module counts its own.
#define MT_EMU_COUNT_ACCESSES(N)                                                                        \
    extern "C" [[gnu::no_sanitize_address, gnu::visibility("hidden"), gnu::weak, gnu::used]] void                      \
    __asan_load##N##_noabort(uintptr_t p) {                                                             \
        mt_emu::count_access(p, N, false, uintptr_t(__builtin_return_address(0)));                      \
    }                                                                                                   \
    extern "C" [[gnu::no_sanitize_address, gnu::visibility("hidden"), gnu::weak, gnu::used]] void                      \
    __asan_store##N##_noabort(uintptr_t p) {                                                            \
        mt_emu::count_access(p, N, true, uintptr_t(__builtin_return_address(0)));                       \
    }
MT_EMU_COUNT_ACCESSES(1)
MT_EMU_COUNT_ACCESSES(2)
MT_EMU_COUNT_ACCESSES(4)
MT_EMU_COUNT_ACCESSES(8)
MT_EMU_COUNT_ACCESSES(16)
#undef MT_EMU_COUNT_ACCESSES
extern "C" [[gnu::no_sanitize_address, gnu::visibility("hidden"), gnu::weak, gnu::used]] void __asan_loadN_noabort(uintptr_t p,
                                                                                                  size_t size) {
    mt_emu::count_access(p, unsigned(size), false, uintptr_t(__builtin_return_address(0)));
}
extern "C" [[gnu::no_sanitize_address, gnu::visibility("hidden"), gnu::weak, gnu::used]] void __asan_storeN_noabort(uintptr_t p,
                                                                                                   size_t size) {
    mt_emu::count_access(p, unsigned(size), true, uintptr_t(__builtin_return_address(0)));
}
// Its other calls, which count nothing: before a call that does not return (a throw, an
// abort), and around the constructors of a source's globals.
extern "C" [[gnu::visibility("hidden"), gnu::weak, gnu::used]] void __asan_handle_no_return() {}
extern "C" [[gnu::visibility("hidden"), gnu::weak, gnu::used]] void __asan_before_dynamic_init(const char*) {}
extern "C" [[gnu::visibility("hidden"), gnu::weak, gnu::used]] void __asan_after_dynamic_init() {}
#endif

#define threadIdx (mt_emu::ts.thread)
#define blockIdx (mt_emu::ts.block_index)
#define blockDim (mt_emu::ts.block_dim)
#define gridDim (mt_emu::ts.grid_dim)
// Left undefined: the build rewrites every __shared__ declaration, and one it missed must not
// compile as something else.
#undef __shared__
#undef __launch_bounds__
#define __launch_bounds__(...)

#define cudaGetLastError() cudaSuccess
#define cudaGetErrorName(e) "emulated"
#define cudaGetErrorString(e) "emulated"
#define cudaFuncSetAttribute(kernel, attribute, value) \
    mt_emu::func_set_attribute(reinterpret_cast<const void*>(kernel), attribute, value)
#define cudaMemsetAsync(ptr, value, bytes, stream) (std::memset((ptr), (value), (bytes)), cudaSuccess)

MT_EMU_COUNTED inline void __syncthreads() {
    MT_EMU_COUNT_HERE(kBarrier, 0, 0);
    mt_emu::ts.block->barrier.arrive_and_wait();
}

inline float __shfl_sync(unsigned, float v, int src) { return mt_emu::shuffle(v, src); }
inline float __shfl_xor_sync(unsigned, float v, int offset) {
    return mt_emu::shuffle(v, mt_emu::lane() ^ offset);
}

// cp.async: size - zfill bytes of the source, then zfill zero bytes, read as issued but written
// only at the __pipeline_wait_prior that covers the copy's group; until then the destination
// holds poison (a read too early gives NaN), and a copy no wait covers never lands.
MT_EMU_COUNTED inline void __pipeline_memcpy_async(void* dst, const void* src, size_t size, size_t zfill = 0) {
    mt_emu::require_aligned(dst, size, "cp.async destination");
    if (zfill < size) mt_emu::require_aligned(src, size, "cp.async source");
    if (zfill < size) MT_EMU_COUNT_HERE(kCpAsyncRead, src, unsigned(size - zfill));
    MT_EMU_COUNT_HERE(kCpAsyncWrite, dst, unsigned(size));
    mt_emu::issue_async_copy(dst, src, size, zfill);
}
inline void __pipeline_commit() { mt_emu::commit_async_copies(); }
inline void __pipeline_wait_prior(size_t pending) { mt_emu::land_async_copies(pending); }

MT_EMU_COUNTED inline float atomicAdd(float* address, float value) {
    MT_EMU_COUNT_HERE(kGlobalAtomic, address, 4);
#ifdef MT_EMU_COUNT
    mt_emu::Unobserved counted;  // above, as one access
#endif
    return std::atomic_ref<float>(*address).fetch_add(value, std::memory_order_relaxed);
}

// CUDA's device-side integer min and max.
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned __umulhi(unsigned a, unsigned b) { return unsigned((uint64_t(a) * b) >> 32); }
inline float __expf(float x) { return std::exp(x); }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }


// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: see mma_16816 in attention.cu for the
// layout (lane = 4 g + t; a[0] A[g][2t..], a[1] A[g+8][2t..], a[2] A[g][2t+8..],
// a[3] A[g+8][2t+8..]; b[0] B[2t..][g], b[1] B[2t+8..][g]; d D[g][2t..], D[g+8][2t..]).
#define MT_EMULATED_MMA 1

// Element `which` (0 low, 1 high) of two 16-bit values of type T packed in a register.
template <typename T>
float unpack_half(uint32_t bits, int which) {
    return float(std::bit_cast<T>(uint16_t(which ? bits >> 16 : bits & 0xffffu)));
}

template <typename T>
MT_EMU_COUNTED void emulated_mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    MT_EMU_COUNT_HERE(kMma, 0, 0);
    const int me = mt_emu::lane(), g = me / 4, t = me % 4;
    // This lane's outputs D[g][2t + c] and D[g + 8][2t + c] need rows g and g + 8 of A, which
    // lanes 4 g + u hold, and columns 2t + c of B, which lanes 4 (2t + c) + u hold (u < 4).
    float A[2][16], B[2][16];  // A[h][k] = A[g + 8h][k], B[c][k] = B[k][2t + c]
    mt_emu::warp_collective(
        [&](mt_emu::Warp::Slots& s) {
            for (int i = 0; i < 4; ++i) s.mma_a[me][i] = a[i];
            for (int i = 0; i < 2; ++i) s.mma_b[me][i] = b[i];
        },
        [&](const mt_emu::Warp::Slots& s) {
            for (int u = 0; u < 4; ++u)
                for (int e = 0; e < 2; ++e) {
                    const uint32_t* ra = s.mma_a[4 * g + u];
                    A[0][2 * u + e] = unpack_half<T>(ra[0], e);
                    A[1][2 * u + e] = unpack_half<T>(ra[1], e);
                    A[0][2 * u + 8 + e] = unpack_half<T>(ra[2], e);
                    A[1][2 * u + 8 + e] = unpack_half<T>(ra[3], e);
                    for (int c = 0; c < 2; ++c) {
                        const uint32_t* rb = s.mma_b[4 * (2 * t + c) + u];
                        B[c][2 * u + e] = unpack_half<T>(rb[0], e);
                        B[c][2 * u + 8 + e] = unpack_half<T>(rb[1], e);
                    }
                }
        });
    for (int e = 0; e < 4; ++e) {
        float acc = d[e];
        for (int k = 0; k < 16; ++k) acc += A[e / 2][k] * B[e % 2][k];
        d[e] = acc;
    }
}

// ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16: lane l gives row l % 8 of 8x8 tile l / 8;
// r[i] of lane 4 g + t = (tile i)[2t][g] | (tile i)[2t + 1][g] << 16. The rows' addresses
// pass between lanes unobserved; the reads of shared memory are the lane's own, and checked.
MT_EMU_COUNTED inline void emulated_ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
    mt_emu::require_aligned(row, 16, "ldmatrix row");
    MT_EMU_COUNT_HERE(kLdmatrix, row, 16);  // this lane's row; the reads below, of others' rows, are not its own
    const int me = mt_emu::lane(), g = me / 4, t = me % 4;
    const uint16_t* pairs[4][2];
    mt_emu::warp_collective([&](mt_emu::Warp::Slots& s) { s.row[me] = row; },
                            [&](const mt_emu::Warp::Slots& s) {
                                for (int i = 0; i < 4; ++i)
                                    for (int k = 0; k < 2; ++k)
                                        pairs[i][k] = static_cast<const uint16_t*>(s.row[8 * i + 2 * t + k]);
                            });
#ifdef MT_EMU_COUNT
    mt_emu::Unobserved counted;  // above, as the lanes' rows
#endif
    for (int i = 0; i < 4; ++i) r[i] = uint32_t(pairs[i][0][g]) | (uint32_t(pairs[i][1][g]) << 16);
}
