// The decode plan's work list, made on the device: the records tactix_decode reads (decode.cu)
// and their count, from each request's kv length and page offset, so that a plan's host work does
// not grow with the batch or its work items (decode.py: `decode_plan_on_device`; the host path,
// `decode_plan_work` and `decode_items`, gives the same records and stays for the batches this
// kernel does not take).
//
// One CTA of TX_PLAN_THREADS threads; requests b <= TX_PLAN_MAX_BATCH. Request i attends keys
// [start, len) (start = max(0, len - 1 - window_left) with a window, else 0), n = len - start of
// them, cut into pieces of `chunk` keys: full = n / chunk pieces of exactly `chunk` keys and, if
// r = n - full * chunk > 0, one short piece of r keys at the end. A request of more than one piece
// is split: its pieces take partial slots first_slot .. first_slot + pieces - 1, in key order,
// with the first slots of split requests in request order; a request of one piece has slot -1 and
// (first_slot, count) = (0, 1). The list holds every full piece, by request and key (the exclusive
// scan of `full` places them), then the short pieces sorted by length, longest first, ties in
// request order (a bitonic sort of the keys (chunk - r) << 32 | i in shared memory). Records: 8
// ints (request, first key, end key, slot, the request's offset in kv_indices, first slot, slot
// count, 0).
//
// The short last wave (decode.py `decode_balance_tail`, eager plans with the automatic chunk:
// `units` > 0): when the list's CTAs (items x units) fill more than one wave of `slots` and leave
// a last wave at most half full, and the items reaching into it are whole requests at least 3/4
// as long as the longest item, those requests are cut into pieces of a multiple of `tile` keys,
// at least `min_chunk`, that fill the last wave; they take the next partial slots in list order
// and go to the end of the list, longest first, ties in the order they were made. The count
// (`num_items`, which the decode kernel reads) is written last; the host sized the grid and the
// workspace for the most this can give (decode.py `decode_bounds`).
//
// Shared memory (dynamic): full[B], slot_first[B] (int), the sort keys (u64, B rounded up to a
// power of two), the scan's per-thread partial sums (2 x TX_PLAN_THREADS ints). The recut reuses
// them: the last items' requests, first keys and ends, and their pieces' first indices.
#ifndef TX_EMULATE
#define TX_DEVICE __device__ __forceinline__
#endif
typedef long long i64;
typedef unsigned long long u64;

#ifndef TX_PLAN_THREADS
#define TX_PLAN_THREADS 256
#endif
#ifndef TX_PLAN_MAX_BATCH
#define TX_PLAN_MAX_BATCH 2048
#endif
#define PLAN_ITEM_INTS 8

// Exclusive prefix sums of a[0..n) and b[0..n) in place (shared memory), and their totals: each
// thread sums a contiguous segment, the segment sums are scanned (Hillis-Steele, in `parts`),
// then each thread writes its segment's prefixes.
TX_DEVICE void tx_plan_scan2(int* a, int* b, int n, int* parts, int& total_a, int& total_b) {
  const int t = threadIdx.x;
  const int per = (n + TX_PLAN_THREADS - 1) / TX_PLAN_THREADS;
  const int lo = t * per < n ? t * per : n, hi = lo + per < n ? lo + per : n;
  int sa = 0, sb = 0;
  for (int i = lo; i < hi; ++i) {
    sa += a[i];
    sb += b[i];
  }
  int* pa = parts;
  int* pb = parts + TX_PLAN_THREADS;
  pa[t] = sa;
  pb[t] = sb;
  __syncthreads();
  for (int step = 1; step < TX_PLAN_THREADS; step <<= 1) {  // inclusive scan of the segment sums
    const int xa = t >= step ? pa[t - step] : 0, xb = t >= step ? pb[t - step] : 0;
    __syncthreads();
    pa[t] += xa;
    pb[t] += xb;
    __syncthreads();
  }
  int ra = pa[t] - sa, rb = pb[t] - sb;  // exclusive: what the earlier segments hold
  for (int i = lo; i < hi; ++i) {
    const int va = a[i], vb = b[i];
    a[i] = ra;
    b[i] = rb;
    ra += va;
    rb += vb;
  }
  total_a = pa[TX_PLAN_THREADS - 1];
  total_b = pb[TX_PLAN_THREADS - 1];
  __syncthreads();
}

extern "C" __global__ void __launch_bounds__(TX_PLAN_THREADS) tactix_decode_plan(
    const int* __restrict__ kv_indptr, const int* __restrict__ kv_lens, int* __restrict__ items,
    int* __restrict__ num_items, i64 batch, i64 chunk_, i64 window_left, i64 units_, i64 slots_, i64 tile_,
    i64 min_chunk_) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int n_req = (int)batch, chunk = (int)chunk_, t = threadIdx.x;
  int pow2 = 1;
  while (pow2 < n_req) pow2 <<= 1;
  u64* keys = (u64*)smem;
  int* full = (int*)(keys + pow2);
  int* slot_first = full + n_req;
  int* parts = slot_first + n_req;

  for (int i = t; i < pow2; i += TX_PLAN_THREADS) {
    u64 key = ~0ull;  // past the batch, or not a short piece: sorts last
    if (i < n_req) {
      const int len = kv_lens[i];
      const int start = window_left >= 0 && len - 1 - window_left > 0 ? (int)(len - 1 - window_left) : 0;
      const int n = len - start, f = n / chunk, r = n - f * chunk;
      const int pieces = f + (r > 0);
      full[i] = f;
      slot_first[i] = pieces > 1 ? pieces : 0;
      if (r > 0) key = ((u64)(unsigned)(chunk - r) << 32) | (u64)(unsigned)i;
    }
    keys[i] = key;
  }
  __syncthreads();
  int total_full = 0, total_slots = 0;
  tx_plan_scan2(full, slot_first, n_req, parts, total_full, total_slots);

  // the short pieces: ascending keys = longest first, ties by request
  for (int size = 2; size <= pow2; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = t; i < pow2; i += TX_PLAN_THREADS) {
        const int j = i ^ stride;
        if (j > i) {
          const bool up = (i & size) == 0;
          const u64 x = keys[i], y = keys[j];
          if ((x > y) == up) {
            keys[i] = y;
            keys[j] = x;
          }
        }
      }
      __syncthreads();
    }
  }

  // the records: every full piece at full[i] + p, then the short ones after all full ones
  for (int i = t; i < n_req; i += TX_PLAN_THREADS) {
    const int len = kv_lens[i];
    const int start = window_left >= 0 && len - 1 - window_left > 0 ? (int)(len - 1 - window_left) : 0;
    const int n = len - start, f = n / chunk, r = n - f * chunk, pieces = f + (r > 0);
    const int next = i + 1 < n_req ? full[i + 1] : total_full;
    const int first = pieces > 1 ? slot_first[i] : 0, count = pieces > 1 ? pieces : 1;
    for (int p = 0; p < next - full[i]; ++p) {
      int* rec = items + PLAN_ITEM_INTS * (full[i] + p);
      rec[0] = i;
      rec[1] = start + p * chunk;
      rec[2] = start + (p + 1) * chunk;
      rec[3] = pieces > 1 ? first + p : -1;
      rec[4] = kv_indptr[i];
      rec[5] = first;
      rec[6] = count;
      rec[7] = 0;
    }
  }
  for (int s = t; s < n_req; s += TX_PLAN_THREADS) {
    const u64 key = keys[s];
    // the count of short pieces: where the sorted keys end (one thread writes it)
    if (key != ~0ull && (s + 1 == n_req || keys[s + 1] == ~0ull)) parts[0] = s + 1;
    if (s == 0 && key == ~0ull) parts[0] = 0;
    if (key == ~0ull) continue;  // (sorted last: the short pieces are keys[0 .. their count))
    const int i = (int)(key & 0xffffffffu);
    const int len = kv_lens[i];
    const int start = window_left >= 0 && len - 1 - window_left > 0 ? (int)(len - 1 - window_left) : 0;
    const int n = len - start, f = n / chunk, pieces = f + 1;
    const int first = pieces > 1 ? slot_first[i] : 0, count = pieces > 1 ? pieces : 1;
    int* rec = items + PLAN_ITEM_INTS * (total_full + s);
    rec[0] = i;
    rec[1] = start + f * chunk;
    rec[2] = len;
    rec[3] = pieces > 1 ? first + pieces - 1 : -1;
    rec[4] = kv_indptr[i];
    rec[5] = first;
    rec[6] = count;
    rec[7] = 0;
  }
  if (t == 0) parts[1] = 0;  // set: an item of the last wave cannot be recut
  __syncthreads();  // (the records, in global memory, are visible to the whole CTA from here)
  const int n_short = parts[0], n_items = total_full + n_short;

  // the short last wave: whether to recut it (the same answer in every thread)
  const i64 units = units_, slots = slots_, ctas = (i64)n_items * units;
  const i64 tail = slots > 0 ? ctas % slots : 0;
  const int count = units > 0 ? (int)((tail + units - 1) / units) : 0;  // items reaching into the last wave
  // the list is longest first: full pieces (`chunk` keys), then the short ones by length
  const i64 longest = total_full > 0 ? chunk : chunk - (i64)(keys[0] >> 32);
  const i64 shortest = n_short > 0 ? chunk - (i64)(keys[n_short - 1] >> 32) : chunk;
  const i64 fit = count > 0 ? slots / ((i64)count * units) : 0, most = min_chunk_ > 0 ? shortest / min_chunk_ : 0;
  const i64 cut = fit < most ? fit : most;  // pieces a recut request is cut into
  if (units <= 0 || ctas <= slots || tail == 0 || 2 * tail > slots || count > n_req || shortest * 4 < longest * 3 ||
      cut < 2) {
    if (t == 0) *num_items = n_items;
    return;
  }
  const int base = n_items - count;  // the first item recut
  int* req_of = full;  // the recut items' requests, first keys and end keys
  int* start_of = slot_first;
  int* end_of = (int*)keys;
  int* piece0 = end_of + pow2;  // the index of each one's first piece among the new ones
  __syncthreads();  // (every thread has read keys[] above)
  for (int k = t; k < count; k += TX_PLAN_THREADS) {
    const int* rec = items + PLAN_ITEM_INTS * (base + k);
    if (rec[3] >= 0) parts[1] = 1;  // a piece of a split request: left alone
    req_of[k] = rec[0];
    start_of[k] = rec[1];
    end_of[k] = rec[2];
  }
  __syncthreads();
  if (parts[1]) {
    if (t == 0) *num_items = n_items;
    return;
  }
  const int tile = (int)tile_;
  // request k: pieces of size_k keys (the fewest multiple of the tile that gives `cut` pieces),
  // the last one shorter or equal; its pieces' first index in piece0[k] (prefix sums, one thread:
  // `count` is at most half a wave of items)
  if (t == 0) {
    int made = 0;
    for (int k = 0; k < count; ++k) {
      const int len = end_of[k] - start_of[k];
      const int size = (int)((len + cut * tile - 1) / (cut * tile)) * tile;
      piece0[k] = made;
      made += (len + size - 1) / size;
    }
    parts[2] = made;
  }
  __syncthreads();
  const int made = parts[2];
  for (int p = t; p < made; p += TX_PLAN_THREADS) {
    int k = 0;  // the request of piece p: the last k with piece0[k] <= p
    for (int lo = 0, hi = count - 1; lo <= hi;) {
      const int mid = (lo + hi) >> 1;
      if (piece0[mid] <= p) {
        k = mid;
        lo = mid + 1;
      } else {
        hi = mid - 1;
      }
    }
    const int len = end_of[k] - start_of[k];
    const int size = (int)((len + cut * tile - 1) / (cut * tile)) * tile;
    const int np = (len + size - 1) / size, j = p - piece0[k];
    const int s0 = start_of[k] + j * size, s1 = min(s0 + size, end_of[k]), mine = s1 - s0;
    // its place: the new pieces longer than it, and those as long made before it (a stable sort,
    // longest first); of its own request's pieces, the j before it (none after it is longer)
    int rank = j;
    for (int o = 0; o < count; ++o) {
      if (o == k) continue;
      const int olen = end_of[o] - start_of[o];
      const int osize = (int)((olen + cut * tile - 1) / (cut * tile)) * tile;
      const int onp = (olen + osize - 1) / osize, orest = olen - (onp - 1) * osize;
      rank += o < k ? (onp - 1) * (osize >= mine) + (orest >= mine) : (onp - 1) * (osize > mine) + (orest > mine);
    }
    int* rec = items + PLAN_ITEM_INTS * (base + rank);
    const int first = (int)total_slots + piece0[k];
    rec[0] = req_of[k];
    rec[1] = s0;
    rec[2] = s1;
    rec[3] = first + j;
    rec[4] = kv_indptr[req_of[k]];
    rec[5] = first;
    rec[6] = np;
    rec[7] = 0;
  }
  if (t == 0) *num_items = base + made;
}
