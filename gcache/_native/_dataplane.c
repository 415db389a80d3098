/* GCache data plane kernels: copy and checksum fused in one pass over the bytes.
 *
 * Two functions, both on lists of buffers ("pieces"), both releasing the GIL:
 *
 *   checksums(src, group, algo=0, threads=0) -> bytes
 *   copy_checksums(dst, src, group, hash_src=False, algo=0, threads=0) -> bytes
 *
 * Every `group` consecutive pieces form one checksummed unit (a layer's K then V
 * is group 2); the result holds one 8-byte big-endian digest per unit, the bytes
 * `xxhash.xxh3_64(piece_0 + piece_1 + ...).digest()` gives (algo 0), or the
 * CRC32C of the unit zero-extended to 8 bytes (algo 1, measured against xxh3).
 *
 * copy_checksums copies src[i] into dst[i] (equal lengths, no overlap) in
 * CHUNK-sized steps and hashes each chunk right after copying it, while it is in
 * the L1/L2 cache: from dst by default (a read hashes the bytes it delivers, not
 * the shared source another process could change between the copy and the hash),
 * from src with hash_src (a write hashes the caller's private bytes).
 *
 * Large calls are split by bytes across threads (the caller's thread is one of
 * them). A unit that straddles two threads' ranges is hashed by the thread that
 * holds its first byte: fused over its own range, then, once every thread has
 * copied its range, over the rest of the unit (from the bytes now in place).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>
#if defined(__x86_64__) || defined(__i386__)
#include <xxh_x86dispatch.h> /* XXH3_64bits_update -> the AVX2/AVX-512 dispatcher */
#define GC_X86 1
#include <nmmintrin.h>
#endif

#define CHUNK ((Py_ssize_t)32 << 10)           /* fused step: copied, then hashed */
#define MIN_PER_THREAD ((Py_ssize_t)4 << 20)   /* bytes that make another thread pay */
#define MAX_THREADS 16

enum { ALGO_XXH3 = 0, ALGO_CRC32C = 1 };

static int g_threads = 2; /* set_threads(); default from the CPU count at import */

/* ---- hash state ---------------------------------------------------------------- */

typedef struct {
    XXH3_state_t xx; /* 64-byte aligned by its own declaration */
    uint32_t crc;
    int algo;
} hstate_t;

#ifdef GC_X86
static int g_have_sse42 = 0;

__attribute__((target("sse4.2"))) static uint32_t crc32c_hw(uint32_t crc, const char *p,
                                                             Py_ssize_t n) {
    uint64_t c = crc;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = _mm_crc32_u64(c, w);
        p += 8;
        n -= 8;
    }
    uint32_t c32 = (uint32_t)c;
    while (n-- > 0) c32 = _mm_crc32_u8(c32, (unsigned char)*p++);
    return c32;
}
#endif

static uint32_t crc32c_table[256];

static void crc32c_init_table(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
        crc32c_table[i] = c;
    }
}

static uint32_t crc32c_update(uint32_t crc, const char *p, Py_ssize_t n) {
#ifdef GC_X86
    if (g_have_sse42) return crc32c_hw(crc, p, n);
#endif
    while (n-- > 0) crc = (crc >> 8) ^ crc32c_table[(crc ^ (unsigned char)*p++) & 0xFF];
    return crc;
}

static void h_reset(hstate_t *h, int algo) {
    h->algo = algo;
    if (algo == ALGO_XXH3)
        XXH3_64bits_reset(&h->xx);
    else
        h->crc = 0xFFFFFFFFu;
}

static void h_update(hstate_t *h, const char *p, Py_ssize_t n) {
    if (n <= 0) return;
    if (h->algo == ALGO_XXH3)
        XXH3_64bits_update(&h->xx, p, (size_t)n);
    else
        h->crc = crc32c_update(h->crc, p, n);
}

static uint64_t h_digest(hstate_t *h) {
    if (h->algo == ALGO_XXH3) return XXH3_64bits_digest(&h->xx);
    return (uint64_t)(h->crc ^ 0xFFFFFFFFu);
}

static void put_be64(unsigned char *out, uint64_t v) {
    for (int i = 7; i >= 0; i--) {
        out[i] = (unsigned char)(v & 0xFF);
        v >>= 8;
    }
}

/* ---- the work ---------------------------------------------------------------------- */

typedef struct {
    char *dst;       /* NULL: hash only */
    const char *src;
    Py_ssize_t len;
    Py_ssize_t start; /* offset of this piece in the concatenation of all pieces */
} piece_t;

typedef struct job job_t;

typedef struct {
    job_t *job;
    int t;
    hstate_t *h; /* this thread's state (owned, 64-byte aligned) */
    /* a unit this thread started and could not finish in its range */
    Py_ssize_t open_unit;  /* -1: none */
    Py_ssize_t open_piece; /* piece to continue from */
    Py_ssize_t open_off;   /* offset inside that piece */
} worker_t;

struct job {
    piece_t *p;
    Py_ssize_t n;     /* pieces */
    Py_ssize_t group; /* pieces per unit */
    Py_ssize_t total; /* bytes */
    int algo;
    int hash_src;
    int nthreads;
    unsigned char *out; /* 8 bytes per unit */
    worker_t w[MAX_THREADS];
};

static inline const char *hash_side(const job_t *j, const piece_t *pc) {
    return (j->hash_src || pc->dst == NULL) ? pc->src : pc->dst;
}

/* Copy [off, off+n) of a piece, hashing it into h (if h) chunk by chunk. */
static void move_span(const job_t *j, const piece_t *pc, Py_ssize_t off, Py_ssize_t n,
                      hstate_t *h) {
    if (n <= 0) return;
    if (pc->dst == NULL) {
        if (h) h_update(h, pc->src + off, n);
        return;
    }
    if (!h) {
        memcpy(pc->dst + off, pc->src + off, (size_t)n);
        return;
    }
    const char *hs = hash_side(j, pc);
    for (Py_ssize_t pos = off, end = off + n; pos < end; pos += CHUNK) {
        Py_ssize_t c = end - pos < CHUNK ? end - pos : CHUNK;
        memcpy(pc->dst + pos, pc->src + pos, (size_t)c);
        h_update(h, hs + pos, c);
    }
}

/* First piece whose bytes reach past global offset a (pieces sorted by start). */
static Py_ssize_t find_piece(const job_t *j, Py_ssize_t a) {
    Py_ssize_t lo = 0, hi = j->n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (j->p[mid].start + j->p[mid].len <= a)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* Unit i's first byte: the start of its first non-empty piece (-1: empty unit). */
static Py_ssize_t unit_first_byte(const job_t *j, Py_ssize_t u) {
    for (Py_ssize_t k = u * j->group; k < (u + 1) * j->group; k++)
        if (j->p[k].len > 0) return j->p[k].start;
    return -1;
}

static void phase1(worker_t *w) {
    job_t *j = w->job;
    Py_ssize_t a = j->total * w->t / j->nthreads;
    Py_ssize_t b = j->total * (w->t + 1) / j->nthreads;
    w->open_unit = -1;
    if (a >= b) return;
    Py_ssize_t k = find_piece(j, a);
    Py_ssize_t cur_unit = -1;
    int hashing = 0;
    for (; k < j->n && j->p[k].start < b; k++) {
        const piece_t *pc = &j->p[k];
        if (pc->len == 0) continue;
        Py_ssize_t u = k / j->group;
        if (u != cur_unit) {
            if (hashing) {
                /* the previous unit ended inside this range */
                put_be64(j->out + 8 * cur_unit, h_digest(w->h));
            }
            cur_unit = u;
            Py_ssize_t first = unit_first_byte(j, u);
            hashing = first >= a; /* we hold the unit's first byte */
            if (hashing) h_reset(w->h, j->algo);
        }
        Py_ssize_t lo = pc->start > a ? 0 : a - pc->start;
        Py_ssize_t hi = pc->start + pc->len <= b ? pc->len : b - pc->start;
        move_span(j, pc, lo, hi - lo, hashing ? w->h : NULL);
        if (hi < pc->len) { /* our range ends inside this piece */
            if (hashing) {
                w->open_unit = u;
                w->open_piece = k;
                w->open_off = hi;
                hashing = 0;
            }
            cur_unit = -1;
            break;
        }
    }
    if (hashing && cur_unit >= 0) {
        /* the range ended on a piece boundary: is the unit complete? */
        Py_ssize_t last = (cur_unit + 1) * j->group; /* one past the unit's pieces */
        Py_ssize_t next = k;                         /* first piece not done here */
        int rest = 0;
        for (Py_ssize_t q = next; q < last; q++)
            if (j->p[q].len > 0) rest = 1;
        if (rest) {
            w->open_unit = cur_unit;
            w->open_piece = next;
            w->open_off = 0;
        } else {
            put_be64(j->out + 8 * cur_unit, h_digest(w->h));
        }
    }
}

/* After every thread copied its range: finish the unit this thread left open,
 * hashing the bytes now in place (dst, or src with hash_src). */
static void phase2(worker_t *w) {
    job_t *j = w->job;
    Py_ssize_t u = w->open_unit;
    if (u < 0) return;
    Py_ssize_t last = (u + 1) * j->group;
    for (Py_ssize_t k = w->open_piece; k < last; k++) {
        const piece_t *pc = &j->p[k];
        Py_ssize_t off = k == w->open_piece ? w->open_off : 0;
        h_update(w->h, hash_side(j, pc) + off, pc->len - off);
    }
    put_be64(j->out + 8 * u, h_digest(w->h));
}

static void *run_phase1(void *arg) {
    phase1((worker_t *)arg);
    return NULL;
}

static void *run_phase2(void *arg) {
    phase2((worker_t *)arg);
    return NULL;
}

/* Run fn for every worker: workers 1.. on threads of their own, worker 0 (and any
 * whose thread could not start) on the caller's; returns once all are done. */
static void run_all(job_t *j, void *(*fn)(void *), int only_open) {
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 1; t < j->nthreads; t++) {
        if (only_open && j->w[t].open_unit < 0) continue;
        started[t] = pthread_create(&tid[t], NULL, fn, &j->w[t]) == 0;
    }
    fn(&j->w[0]);
    for (int t = 1; t < j->nthreads; t++) {
        if (started[t])
            pthread_join(tid[t], NULL);
        else if (!only_open || j->w[t].open_unit >= 0)
            fn(&j->w[t]);
    }
}

static void run_job(job_t *j) {
    /* empty units: their digest is the hash of nothing */
    Py_ssize_t units = j->n / j->group;
    for (Py_ssize_t u = 0; u < units; u++) {
        if (unit_first_byte(j, u) < 0) {
            hstate_t *h = j->w[0].h;
            h_reset(h, j->algo);
            put_be64(j->out + 8 * u, h_digest(h));
        }
    }
    /* phase 1: every thread copies its byte range, hashing the units it starts;
     * phase 2 (once all bytes are in place): each finishes the unit it left open */
    run_all(j, run_phase1, 0);
    run_all(j, run_phase2, 1);
}

/* ---- Python glue -------------------------------------------------------------------- */

typedef struct {
    Py_buffer *views;
    Py_ssize_t n;
} bufs_t;

static void release_bufs(bufs_t *b) {
    if (!b->views) return;
    for (Py_ssize_t i = 0; i < b->n; i++) PyBuffer_Release(&b->views[i]);
    PyMem_Free(b->views);
    b->views = NULL;
}

/* Buffers of every item of a sequence (contiguous; writable for dst). */
static int get_bufs(PyObject *seq, int writable, bufs_t *out, const char *what) {
    out->views = NULL;
    out->n = 0;
    PyObject *fast = PySequence_Fast(seq, what);
    if (!fast) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    out->views = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    if (!out->views) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    int flags = writable ? (PyBUF_SIMPLE | PyBUF_WRITABLE) : PyBUF_SIMPLE;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyObject_GetBuffer(items[i], &out->views[i], flags) < 0) {
            release_bufs(out);
            Py_DECREF(fast);
            return -1;
        }
        out->n = i + 1;
    }
    Py_DECREF(fast);
    return 0;
}

/* A job over pieces p[0..n): as many threads as its size pays for (at most
   `threads`, or the set_threads() default), each with its own 64-byte aligned hash
   state. NULL with MemoryError set when out of memory; free with free_job(). */
static job_t *new_job(piece_t *p, Py_ssize_t n, Py_ssize_t group, Py_ssize_t total, int algo,
                      int hash_src, int threads, unsigned char *out) {
    int nt = threads > 0 ? threads : g_threads;
    if (nt > MAX_THREADS) nt = MAX_THREADS;
    Py_ssize_t by_size = total / MIN_PER_THREAD;
    if (by_size < nt) nt = by_size < 1 ? 1 : (int)by_size;
    job_t *j = NULL;
    hstate_t *states = NULL;
    if (posix_memalign((void **)&j, 64, sizeof(job_t)) != 0 ||
        posix_memalign((void **)&states, 64, (size_t)nt * sizeof(hstate_t)) != 0) {
        free(j);
        PyErr_NoMemory();
        return NULL;
    }
    memset(j, 0, sizeof(*j));
    j->p = p;
    j->n = n;
    j->group = group;
    j->total = total;
    j->algo = algo;
    j->hash_src = hash_src;
    j->nthreads = nt;
    j->out = out;
    for (int t = 0; t < nt; t++) {
        j->w[t].job = j;
        j->w[t].t = t;
        j->w[t].h = &states[t];
    }
    return j;
}

static void free_job(job_t *j) {
    free(j->w[0].h); /* the states, allocated as one array */
    free(j);
}

static PyObject *do_job(bufs_t *dst, bufs_t *src, Py_ssize_t group, int hash_src, int algo,
                        int threads) {
    Py_ssize_t n = src->n;
    if (group <= 0) {
        PyErr_SetString(PyExc_ValueError, "group must be positive");
        return NULL;
    }
    if (n % group != 0) {
        PyErr_Format(PyExc_ValueError, "%zd pieces are not whole groups of %zd", n, group);
        return NULL;
    }
    if (algo != ALGO_XXH3 && algo != ALGO_CRC32C) {
        PyErr_SetString(PyExc_ValueError, "algo must be 0 (xxh3-64) or 1 (crc32c)");
        return NULL;
    }
    if (dst && dst->n != n) {
        PyErr_Format(PyExc_ValueError, "%zd destinations for %zd sources", dst->n, n);
        return NULL;
    }
    piece_t *p = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(piece_t));
    if (!p) return PyErr_NoMemory();
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        p[i].src = (const char *)src->views[i].buf;
        p[i].len = src->views[i].len;
        p[i].start = total;
        p[i].dst = NULL;
        if (dst) {
            if (dst->views[i].len != p[i].len) {
                PyErr_Format(PyExc_ValueError, "piece %zd: %zd bytes into a %zd-byte destination",
                             i, p[i].len, dst->views[i].len);
                PyMem_Free(p);
                return NULL;
            }
            p[i].dst = (char *)dst->views[i].buf;
        }
        total += p[i].len;
    }
    Py_ssize_t units = n / group;
    PyObject *res = PyBytes_FromStringAndSize(NULL, 8 * units);
    if (!res) {
        PyMem_Free(p);
        return NULL;
    }
    job_t *j = new_job(p, n, group, total, algo, hash_src, threads,
                       (unsigned char *)PyBytes_AS_STRING(res));
    if (!j) {
        PyMem_Free(p);
        Py_DECREF(res);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    run_job(j);
    Py_END_ALLOW_THREADS
    free_job(j);
    PyMem_Free(p);
    return res;
}

static PyObject *py_checksums(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"src", "group", "algo", "threads", NULL};
    PyObject *src_seq;
    Py_ssize_t group;
    int algo = ALGO_XXH3, threads = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "On|ii", kwlist, &src_seq, &group, &algo,
                                     &threads))
        return NULL;
    bufs_t src;
    if (get_bufs(src_seq, 0, &src, "src must be a sequence of buffers") < 0) return NULL;
    PyObject *res = do_job(NULL, &src, group, 1, algo, threads);
    release_bufs(&src);
    return res;
}

static PyObject *py_copy_checksums(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"dst", "src", "group", "hash_src", "algo", "threads", NULL};
    PyObject *dst_seq, *src_seq;
    Py_ssize_t group;
    int hash_src = 0, algo = ALGO_XXH3, threads = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOn|pii", kwlist, &dst_seq, &src_seq, &group,
                                     &hash_src, &algo, &threads))
        return NULL;
    bufs_t src, dst;
    if (get_bufs(src_seq, 0, &src, "src must be a sequence of buffers") < 0) return NULL;
    if (get_bufs(dst_seq, 1, &dst, "dst must be a sequence of writable buffers") < 0) {
        release_bufs(&src);
        return NULL;
    }
    PyObject *res = do_job(&dst, &src, group, hash_src, algo, threads);
    release_bufs(&dst);
    release_bufs(&src);
    return res;
}

/* read_layer(seg, kdst, vdst, offsets, rows, sums, stride, li, off, kb, vb, threads=0)
 *   -> int: one layer of n blocks out of a mapped segment, planned, copied and
 * verified in one call. Block r's K is
 * seg[offsets[r] + off, +kb), its V the vb bytes after it; they land in rows
 * rows[r] of kdst (kb bytes a row) and vdst (vb bytes a row), and
 * xxh3-64(K || V) of what landed is compared with the 8 bytes at
 * sums[r * stride + 8 * li]. offsets and rows are int64 buffers of n entries.
 * Returns -1 when every block matched, else the first block that did not.
 * Every range is checked against the buffers' sizes first (ValueError), so no
 * byte moves unless all of them may. */
static PyObject *py_read_layer(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"seg", "kdst", "vdst", "offsets", "rows", "sums", "stride",
                             "li",  "off",  "kb",   "vb",      "threads", NULL};
    Py_buffer seg, kd, vd, offs, rows, sums;
    Py_ssize_t stride, li, off, kb, vb;
    int threads = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*w*w*y*y*y*nnnnn|i", kwlist, &seg, &kd, &vd,
                                     &offs, &rows, &sums, &stride, &li, &off, &kb, &vb,
                                     &threads))
        return NULL;
    PyObject *res = NULL;
    piece_t *p = NULL;
    Py_ssize_t n = offs.len / 8;
    const int64_t *o = (const int64_t *)offs.buf;
    const int64_t *rw = (const int64_t *)rows.buf;
    if (offs.len % 8 || rows.len != offs.len) {
        PyErr_SetString(PyExc_ValueError, "offsets and rows must be int64 buffers of equal length");
        goto done;
    }
    if (kb < 0 || vb < 0 || off < 0 || li < 0 || stride < 8 * (li + 1) || sums.len < n * stride) {
        PyErr_SetString(PyExc_ValueError, "bad layer geometry or checksum table");
        goto done;
    }
    Py_ssize_t krows = kb ? kd.len / kb : 0, vrows = vb ? vd.len / vb : 0;
    for (Py_ssize_t r = 0; r < n; r++) {
        if (o[r] < 0 || o[r] > seg.len || seg.len - o[r] < off + kb + vb) {
            PyErr_Format(PyExc_ValueError, "block %zd: range [%lld, +%zd) outside the segment", r,
                         (long long)o[r] + off, kb + vb);
            goto done;
        }
        if (rw[r] < 0 || (kb && rw[r] >= krows) || (vb && rw[r] >= vrows)) {
            PyErr_Format(PyExc_ValueError, "block %zd: row %lld outside the destination", r,
                         (long long)rw[r]);
            goto done;
        }
    }
    p = PyMem_Malloc((size_t)(n ? 2 * n : 1) * sizeof(piece_t));
    if (!p) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t total = 0;
    for (Py_ssize_t r = 0; r < n; r++) {
        const char *src = (const char *)seg.buf + o[r] + off;
        p[2 * r] = (piece_t){(char *)kd.buf + rw[r] * kb, src, kb, total};
        total += kb;
        p[2 * r + 1] = (piece_t){(char *)vd.buf + rw[r] * vb, src + kb, vb, total};
        total += vb;
    }
    unsigned char *got = PyMem_Malloc((size_t)(n ? 8 * n : 1));
    if (!got) {
        PyErr_NoMemory();
        goto done;
    }
    /* hash what landed in the caller's buffers (hash_src 0) */
    job_t *j = new_job(p, 2 * n, 2, total, ALGO_XXH3, 0, threads, got);
    if (!j) {
        PyMem_Free(got);
        goto done;
    }
    Py_ssize_t bad = -1;
    const unsigned char *want = (const unsigned char *)sums.buf;
    Py_BEGIN_ALLOW_THREADS
    run_job(j);
    for (Py_ssize_t r = 0; r < n; r++) {
        if (memcmp(got + 8 * r, want + r * stride + 8 * li, 8) != 0) {
            bad = r;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    free_job(j);
    PyMem_Free(got);
    res = PyLong_FromSsize_t(bad);
done:
    PyMem_Free(p);
    PyBuffer_Release(&seg);
    PyBuffer_Release(&kd);
    PyBuffer_Release(&vd);
    PyBuffer_Release(&offs);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&sums);
    return res;
}

static PyObject *py_set_threads(PyObject *self, PyObject *arg) {
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 1 || n > MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "threads must be 1..%d", MAX_THREADS);
        return NULL;
    }
    int old = g_threads;
    g_threads = (int)n;
    return PyLong_FromLong(old);
}

static PyMethodDef methods[] = {
    {"checksums", (PyCFunction)(void (*)(void))py_checksums, METH_VARARGS | METH_KEYWORDS,
     "checksums(src, group, algo=0, threads=0) -> bytes: one 8-byte digest per group of "
     "pieces (GIL released)."},
    {"copy_checksums", (PyCFunction)(void (*)(void))py_copy_checksums,
     METH_VARARGS | METH_KEYWORDS,
     "copy_checksums(dst, src, group, hash_src=False, algo=0, threads=0) -> bytes: copy "
     "src[i] into dst[i] and checksum every group of pieces in the same pass."},
    {"read_layer", (PyCFunction)(void (*)(void))py_read_layer, METH_VARARGS | METH_KEYWORDS,
     "read_layer(seg, kdst, vdst, offsets, rows, sums, stride, li, off, kb, vb, threads=0) "
     "-> int: copy one layer's blocks out of a segment and verify them in one pass; -1 or "
     "the first block whose checksum did not match."},
    {"set_threads", py_set_threads, METH_O,
     "set_threads(n) -> previous: threads a large call is split across."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_dataplane", "GCache fused copy + checksum kernels.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__dataplane(void) {
    crc32c_init_table();
#ifdef GC_X86
    __builtin_cpu_init();
    g_have_sse42 = __builtin_cpu_supports("sse4.2");
#endif
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    g_threads = ncpu < 1 ? 1 : (ncpu > 4 ? 4 : (int)ncpu);
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    if (PyModule_AddIntConstant(m, "ALGO_XXH3", ALGO_XXH3) < 0 ||
        PyModule_AddIntConstant(m, "ALGO_CRC32C", ALGO_CRC32C) < 0 ||
        PyModule_AddIntConstant(m, "HW_CRC32C",
#ifdef GC_X86
                                g_have_sse42 != 0
#else
                                0
#endif
                                ) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
