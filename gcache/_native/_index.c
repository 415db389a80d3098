/* The compact index's scalar steps in C: over the same numpy columns the Python
 * code of gcache/meta/{tickheap,keymap,compact}.py keeps, so a heap sift or a key
 * probe is a few nanoseconds a step instead of a numpy scalar read (~100 ns) each.
 *
 *   heap_sift(heap, tick, seq, hpos, size, i) -> int
 *       restore the min-heap order around position i of `heap` (int32 row ids
 *       keyed by the uint64 `tick` column, ties by the uint64 `seq` column; `hpos`
 *       int32 holds each row's place): sift up, then down; returns the item's
 *       final position.
 *   key_find1(table, k0, k1, ns, key, nsid) -> int
 *       the block id of one 16-byte key of namespace `nsid` in the open-addressing
 *       `table` (int32; -1 empty, -2 tombstone), or -1.
 *   key_find_list(table, k0, k1, ns, keys, nsid, out) -> None
 *       the block id of each 16-byte key of the list `keys` into the int32 `out`
 *       (-1: absent): a prompt's probes without joining or splitting its keys.
 *   key_prefix(table, k0, k1, ns, obj, groups, nsid, keys, full) -> list
 *       the block ids of the leading keys of the list `keys` that are indexed
 *       and (full >= 0) hold an object of group `full`: a small lookup's match.
 *   key_slot(table, k0, ns, bid) -> int
 *       the table slot that holds block `bid` (-1: not there).
 *   match(table, k0, k1, ns, obj, groups, nsid, keys, group) -> int
 *       how many leading 16-byte keys of the list `keys` have an object
 *       of `group` (`obj` int32, `groups` per block): a binary search of probes,
 *       for the prefix-closed group.
 *   live_get(keys, vals, k) -> int
 *   live_put(keys, vals, k, v) -> int
 *   live_pop(keys, vals, k) -> int
 *       an allocator's live map (start unit -> size units of each live range):
 *       open addressing in two uint32 arrays (a key is stored as k + 1; 0 marks
 *       an empty slot, 0xFFFFFFFF a removed one). get and pop answer the value
 *       or -1; put answers 1 (added), 0 (replaced) or -1 (no free slot).
 *   live_put_many(keys, vals, units, values) -> int
 *       put of each pair of two int64 arrays; the count added (a caller keeps
 *       the table under 3/4 full first).
 *   key_place(table, k0, ns, ids) -> int
 *       put each block id of the int32 `ids` (its key not in the table) into its
 *       first free slot; the tombstones so reused.
 *   live_get_many(keys, vals, units, out) -> int
 *       get of each unit of an int64 array into the int64 `out` (-1: absent);
 *       the count found.
 *   key_find_cols(table, k0, k1, ns, q0, q1, nsid, out) -> None
 *       key_find_list for keys given as two uint64 columns (a report chunk's).
 *   lease_rows(rows, tick, atime, <14 object and block columns>, slabs, heap0,
 *              size0, seq0, heap1, size1, seq1) -> (fields, seq0, seq1)
 *       a small lease (a list of at most 64 object rows) in one pass: each
 *       pinned, touched (tick, access time, re-sifted in its heap with the next
 *       sequence number) and read for the reply: (server, offset, length, tier,
 *       group, block position, checksums) per row. Every row is checked first
 *       (ValueError: nothing changed).
 *   unpin_rows(rows, pins, block, hpos, group, tier, ns, hot, children, full)
 *       -> list
 *       each row's pin taken back (checked first, as often as named); the rows
 *       whose last pin this was and that are out of their heap and either
 *       detached or evictable: the caller frees or re-queues them.
 *
 * (lease_rows and unpin_rows live in _lease.c; what both files share in _index.h.)
 *
 * Every index read from an array is bounds-checked (a wrong caller gets an
 * IndexError, never a stray read). No allocation, no GIL release (each call is
 * microseconds). */
#include "_index.h"

/* ---- heap ------------------------------------------------------------------------ */

static PyObject *py_heap_sift(PyObject *self, PyObject *args) {
    PyObject *ho, *to, *so, *po;
    Py_ssize_t size, i;
    if (!PyArg_ParseTuple(args, "OOOOnn", &ho, &to, &so, &po, &size, &i)) return NULL;
    buf_t hb = {0}, tb = {0}, sb = {0}, pb = {0};
    PyObject *res = NULL;
    if (get(ho, &hb, 4, 1, "heap") < 0 || get(to, &tb, 8, 0, "tick") < 0 ||
        get(so, &sb, 8, 0, "seq") < 0 || get(po, &pb, 4, 1, "hpos") < 0)
        goto done;
    if (size < 0 || size > N(hb, int32_t)) { res = oob("heap size", size); goto done; }
    if (i < 0 || i >= size) { res = oob("heap position", i); goto done; }
    Py_ssize_t at = sift(hb.b.buf, size, tb.b.buf, sb.b.buf, pb.b.buf,
                         MIN3(N(tb, uint64_t), N(sb, uint64_t), N(pb, int32_t)), i);
    if (at >= 0) res = PyLong_FromSsize_t(at);
done:
    put(&hb); put(&tb); put(&sb); put(&pb);
    return res;
}

/* ---- key map --------------------------------------------------------------------- */

typedef struct {
    const int32_t *table;
    Py_ssize_t nslots; /* a power of two */
    const uint64_t *k0, *k1;
    const uint16_t *ns;
    Py_ssize_t nblocks;
} keymap_t;

/* -1: absent; -3: a table entry out of the blocks' range (the caller raises). */
static int32_t find1(const keymap_t *m, uint64_t k0, uint64_t k1, uint16_t nsid) {
    uint64_t mask = (uint64_t)m->nslots - 1;
    uint64_t h = (k0 ^ ((uint64_t)nsid * MIX)) & mask;
    for (Py_ssize_t probes = 0; probes < m->nslots; probes++) {
        int32_t t = m->table[h];
        if (t == EMPTY) return -1;
        if (t >= 0) {
            if (t >= m->nblocks) return -3;
            if (m->k0[t] == k0 && m->k1[t] == k1 && m->ns[t] == nsid) return t;
        }
        h = (h + 1) & mask;
    }
    return -1;
}

static int keymap_get(keymap_t *m, buf_t *tb, buf_t *k0b, buf_t *k1b, buf_t *nsb, PyObject *to,
                      PyObject *k0o, PyObject *k1o, PyObject *nso) {
    if (get(to, tb, 4, 0, "table") < 0 || get(k0o, k0b, 8, 0, "k0") < 0 ||
        get(k1o, k1b, 8, 0, "k1") < 0 || get(nso, nsb, 2, 0, "ns") < 0)
        return -1;
    m->table = tb->b.buf;
    m->nslots = N(*tb, int32_t);
    if (m->nslots == 0 || (m->nslots & (m->nslots - 1))) {
        PyErr_SetString(PyExc_ValueError, "table: size must be a power of two");
        return -1;
    }
    m->k0 = k0b->b.buf;
    m->k1 = k1b->b.buf;
    m->ns = nsb->b.buf;
    m->nblocks = N(*k0b, uint64_t);
    if (N(*k1b, uint64_t) < m->nblocks) m->nblocks = N(*k1b, uint64_t);
    if (N(*nsb, uint16_t) < m->nblocks) m->nblocks = N(*nsb, uint16_t);
    return 0;
}

static uint64_t le64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v; /* x86-64 and aarch64 Linux are little-endian, as the columns are */
}

static PyObject *py_key_find1(PyObject *self, PyObject *args) {
    PyObject *to, *k0o, *k1o, *nso;
    Py_buffer key;
    int nsid;
    if (!PyArg_ParseTuple(args, "OOOOy*i", &to, &k0o, &k1o, &nso, &key, &nsid)) return NULL;
    buf_t tb = {0}, k0b = {0}, k1b = {0}, nsb = {0};
    keymap_t m;
    PyObject *res = NULL;
    if (keymap_get(&m, &tb, &k0b, &k1b, &nsb, to, k0o, k1o, nso) < 0) goto done;
    if (key.len != 16) {
        PyErr_Format(PyExc_ValueError, "a block key is 16 bytes, got %zd", key.len);
        goto done;
    }
    const unsigned char *p = key.buf;
    int32_t r = find1(&m, le64(p), le64(p + 8), (uint16_t)nsid);
    res = r == -3 ? oob("table entry", r) : PyLong_FromLong(r);
done:
    PyBuffer_Release(&key);
    put(&tb); put(&k0b); put(&k1b); put(&nsb);
    return res;
}

/* The block id of one key of a list (-1: absent) into *b; -1 with an error set
 * when the item is not a 16-byte key or the table names a row past the blocks. */
static int probe_item(const keymap_t *m, PyObject *k, uint16_t nsid, int32_t *b) {
    if (!PyBytes_Check(k) || PyBytes_GET_SIZE(k) != 16) {
        PyErr_SetString(PyExc_ValueError, "block keys are 16 bytes each");
        return -1;
    }
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(k);
    *b = find1(m, le64(p), le64(p + 8), nsid);
    if (*b == -3) { oob("table entry", *b); return -1; }
    return 0;
}

static PyObject *py_key_find_list(PyObject *self, PyObject *args) {
    PyObject *to, *k0o, *k1o, *nso, *keylist, *outo;
    int nsid;
    if (!PyArg_ParseTuple(args, "OOOOO!iO", &to, &k0o, &k1o, &nso, &PyList_Type, &keylist, &nsid,
                          &outo))
        return NULL;
    buf_t tb = {0}, k0b = {0}, k1b = {0}, nsb = {0}, ob = {0};
    keymap_t m;
    PyObject *res = NULL;
    if (keymap_get(&m, &tb, &k0b, &k1b, &nsb, to, k0o, k1o, nso) < 0 ||
        get(outo, &ob, 4, 1, "out") < 0)
        goto done;
    Py_ssize_t n = PyList_GET_SIZE(keylist);
    if (N(ob, int32_t) < n) {
        PyErr_Format(PyExc_ValueError, "out: room for %zd ids, %zd keys", N(ob, int32_t), n);
        goto done;
    }
    int32_t *out = ob.b.buf;
    for (Py_ssize_t i = 0; i < n; i++)
        if (probe_item(&m, PyList_GET_ITEM(keylist, i), (uint16_t)nsid, &out[i]) < 0) goto done;
    res = Py_NewRef(Py_None);
done:
    put(&tb); put(&k0b); put(&k1b); put(&nsb); put(&ob);
    return res;
}

/* The leading keys that are indexed (and, full >= 0, hold an object of group
 * `full`), as a list of their block ids: a small lookup's probes, with no array
 * made for them. */
static PyObject *py_key_prefix(PyObject *self, PyObject *args) {
    PyObject *to, *k0o, *k1o, *nso, *objo, *keylist;
    Py_ssize_t groups;
    int nsid, full;
    if (!PyArg_ParseTuple(args, "OOOOOniO!i", &to, &k0o, &k1o, &nso, &objo, &groups, &nsid,
                          &PyList_Type, &keylist, &full))
        return NULL;
    buf_t tb = {0}, k0b = {0}, k1b = {0}, nsb = {0}, ob = {0};
    keymap_t m;
    PyObject *res = NULL, *out = NULL;
    if (keymap_get(&m, &tb, &k0b, &k1b, &nsb, to, k0o, k1o, nso) < 0 ||
        get(objo, &ob, 4, 0, "obj") < 0)
        goto done;
    if (groups < 1 || full >= groups) {
        PyErr_Format(PyExc_ValueError, "group %d of %zd groups", full, groups);
        goto done;
    }
    const int32_t *obj = ob.b.buf;
    Py_ssize_t cells = N(ob, int32_t);
    Py_ssize_t n = PyList_GET_SIZE(keylist);
    if (!(out = PyList_New(0))) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t b;
        if (probe_item(&m, PyList_GET_ITEM(keylist, i), (uint16_t)nsid, &b) < 0) goto done;
        if (b < 0) break;
        if (full >= 0) {
            Py_ssize_t at = (Py_ssize_t)b * groups + full;
            if (at >= cells) { oob("block", b); goto done; }
            if (obj[at] < 0) break;
        }
        PyObject *v = PyLong_FromLong(b);
        if (!v || PyList_Append(out, v) < 0) { Py_XDECREF(v); goto done; }
        Py_DECREF(v);
    }
    res = out;
    out = NULL;
done:
    Py_XDECREF(out);
    put(&tb); put(&k0b); put(&k1b); put(&nsb); put(&ob);
    return res;
}

static PyObject *py_key_slot(PyObject *self, PyObject *args) {
    PyObject *to, *k0o, *nso;
    Py_ssize_t bid;
    if (!PyArg_ParseTuple(args, "OOOn", &to, &k0o, &nso, &bid)) return NULL;
    buf_t tb = {0}, k0b = {0}, nsb = {0};
    PyObject *res = NULL;
    if (get(to, &tb, 4, 0, "table") < 0 || get(k0o, &k0b, 8, 0, "k0") < 0 ||
        get(nso, &nsb, 2, 0, "ns") < 0)
        goto done;
    Py_ssize_t nslots = N(tb, int32_t);
    if (nslots == 0 || (nslots & (nslots - 1))) {
        PyErr_SetString(PyExc_ValueError, "table: size must be a power of two");
        goto done;
    }
    if (bid < 0 || bid >= N(k0b, uint64_t) || bid >= N(nsb, uint16_t)) {
        res = oob("block", bid);
        goto done;
    }
    const int32_t *table = tb.b.buf;
    uint64_t mask = (uint64_t)nslots - 1;
    uint64_t h = (((const uint64_t *)k0b.b.buf)[bid] ^
                  ((uint64_t)((const uint16_t *)nsb.b.buf)[bid] * MIX)) & mask;
    Py_ssize_t slot = -1;
    for (Py_ssize_t probes = 0; probes < nslots; probes++) {
        if (table[h] == (int32_t)bid) { slot = (Py_ssize_t)h; break; }
        if (table[h] == EMPTY) break;
        h = (h + 1) & mask;
    }
    res = PyLong_FromSsize_t(slot);
done:
    put(&tb); put(&k0b); put(&nsb);
    return res;
}

static PyObject *py_match(PyObject *self, PyObject *args) {
    PyObject *to, *k0o, *k1o, *nso, *objo;
    Py_ssize_t groups, group;
    int nsid;
    PyObject *keylist;
    if (!PyArg_ParseTuple(args, "OOOOOniO!n", &to, &k0o, &k1o, &nso, &objo, &groups, &nsid,
                          &PyList_Type, &keylist, &group))
        return NULL;
    buf_t tb = {0}, k0b = {0}, k1b = {0}, nsb = {0}, ob = {0};
    keymap_t m;
    PyObject *res = NULL;
    if (keymap_get(&m, &tb, &k0b, &k1b, &nsb, to, k0o, k1o, nso) < 0 ||
        get(objo, &ob, 4, 0, "obj") < 0)
        goto done;
    if (groups < 1 || group < 0 || group >= groups) {
        PyErr_Format(PyExc_ValueError, "group %zd of %zd", group, groups);
        goto done;
    }
    const int32_t *obj = ob.b.buf;
    Py_ssize_t nobj_rows = N(ob, int32_t) / groups;
    Py_ssize_t n = PyList_GET_SIZE(keylist), lo = 0, hi = n;
    /* 1: present, 0: absent, -1: an error is set (a key not 16 bytes, a bad table). */
#define HAS(idx, out)                                                                    \
    do {                                                                                 \
        PyObject *k_ = PyList_GET_ITEM(keylist, (idx));                                  \
        if (!PyBytes_Check(k_) || PyBytes_GET_SIZE(k_) != 16) {                          \
            PyErr_SetString(PyExc_ValueError, "block keys are 16 bytes each");          \
            (out) = -1;                                                                  \
            break;                                                                       \
        }                                                                                \
        const unsigned char *p_ = (const unsigned char *)PyBytes_AS_STRING(k_);          \
        int32_t b_ = find1(&m, le64(p_), le64(p_ + 8), (uint16_t)nsid);                  \
        if (b_ == -3 || b_ >= nobj_rows) { oob("block", b_); (out) = -1; }               \
        else (out) = b_ >= 0 && obj[(Py_ssize_t)b_ * groups + group] >= 0;              \
    } while (0)
    int h;
    if (hi) {
        HAS(hi - 1, h);
        if (h < 0) goto done;
        if (h) { res = PyLong_FromSsize_t(n); goto done; }
    }
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        HAS(mid, h);
        if (h < 0) goto done;
        if (h) lo = mid + 1;
        else hi = mid;
    }
#undef HAS
    res = PyLong_FromSsize_t(lo);
done:
    put(&tb); put(&k0b); put(&k1b); put(&nsb); put(&ob);
    return res;
}

/* ---- an allocator's live map -------------------------------------------------------- */

#define LM_EMPTY 0u
#define LM_TOMB 0xFFFFFFFFu

static int lm_args(PyObject *args, const char *fmt, buf_t *kb, buf_t *vb, long long *k,
                   long long *v, uint32_t **keys, uint32_t **vals, Py_ssize_t *n) {
    PyObject *ko, *vo;
    int ok = v ? PyArg_ParseTuple(args, fmt, &ko, &vo, k, v)
               : PyArg_ParseTuple(args, fmt, &ko, &vo, k);
    if (!ok) return -1;
    if (get(ko, kb, 4, 1, "keys") < 0 || get(vo, vb, 4, 1, "vals") < 0) return -1;
    *n = N(*kb, uint32_t);
    if (*n == 0 || (*n & (*n - 1)) || N(*vb, uint32_t) != *n) {
        PyErr_SetString(PyExc_ValueError, "live map: keys and vals of one power-of-two size");
        return -1;
    }
    if (*k < 0 || *k >= (long long)LM_TOMB - 1) {
        PyErr_Format(PyExc_ValueError, "live map: key %lld out of range", *k);
        return -1;
    }
    *keys = kb->b.buf;
    *vals = vb->b.buf;
    return 0;
}

/* The slot holding key `want` (stored form), or -1; `*free_at`: the first empty or
 * removed slot on its probe path (-1: none). */
static Py_ssize_t lm_find(const uint32_t *keys, Py_ssize_t n, uint32_t want, Py_ssize_t *free_at) {
    uint64_t mask = (uint64_t)n - 1;
    uint64_t h = ((uint64_t)want * 0x9E3779B97F4A7C15ULL >> 32) & mask;
    *free_at = -1;
    for (Py_ssize_t probes = 0; probes < n; probes++) {
        uint32_t at = keys[h];
        if (at == want) return (Py_ssize_t)h;
        if (at == LM_EMPTY) {
            if (*free_at < 0) *free_at = (Py_ssize_t)h;
            return -1;
        }
        if (at == LM_TOMB && *free_at < 0) *free_at = (Py_ssize_t)h;
        h = (h + 1) & mask;
    }
    return -1;
}

static PyObject *py_live_get(PyObject *self, PyObject *args) {
    buf_t kb = {0}, vb = {0};
    long long k;
    uint32_t *keys, *vals;
    Py_ssize_t n, free_at;
    PyObject *res = NULL;
    if (lm_args(args, "OOL", &kb, &vb, &k, NULL, &keys, &vals, &n) < 0) goto done;
    Py_ssize_t at = lm_find(keys, n, (uint32_t)(k + 1), &free_at);
    res = PyLong_FromLongLong(at < 0 ? -1 : (long long)vals[at]);
done:
    put(&kb); put(&vb);
    return res;
}

static PyObject *py_live_put(PyObject *self, PyObject *args) {
    buf_t kb = {0}, vb = {0};
    long long k, v;
    uint32_t *keys, *vals;
    Py_ssize_t n, free_at;
    PyObject *res = NULL;
    if (lm_args(args, "OOLL", &kb, &vb, &k, &v, &keys, &vals, &n) < 0) goto done;
    if (v < 0 || v > (long long)0xFFFFFFFFu) {
        PyErr_Format(PyExc_ValueError, "live map: value %lld out of range", v);
        goto done;
    }
    Py_ssize_t at = lm_find(keys, n, (uint32_t)(k + 1), &free_at);
    if (at >= 0) {
        vals[at] = (uint32_t)v;
        res = PyLong_FromLong(0);
    } else if (free_at >= 0) {
        keys[free_at] = (uint32_t)(k + 1);
        vals[free_at] = (uint32_t)v;
        res = PyLong_FromLong(1);
    } else {
        res = PyLong_FromLong(-1);
    }
done:
    put(&kb); put(&vb);
    return res;
}

static PyObject *py_live_pop(PyObject *self, PyObject *args) {
    buf_t kb = {0}, vb = {0};
    long long k;
    uint32_t *keys, *vals;
    Py_ssize_t n, free_at;
    PyObject *res = NULL;
    if (lm_args(args, "OOL", &kb, &vb, &k, NULL, &keys, &vals, &n) < 0) goto done;
    Py_ssize_t at = lm_find(keys, n, (uint32_t)(k + 1), &free_at);
    if (at < 0) {
        res = PyLong_FromLong(-1);
    } else {
        keys[at] = LM_TOMB;
        res = PyLong_FromLongLong((long long)vals[at]);
    }
done:
    put(&kb); put(&vb);
    return res;
}

static PyObject *py_live_put_many(PyObject *self, PyObject *args) {
    PyObject *ko, *vo, *kso, *vso;
    if (!PyArg_ParseTuple(args, "OOOO", &ko, &vo, &kso, &vso)) return NULL;
    buf_t kb = {0}, vb = {0}, ksb = {0}, vsb = {0};
    PyObject *res = NULL;
    if (get(ko, &kb, 4, 1, "keys") < 0 || get(vo, &vb, 4, 1, "vals") < 0 ||
        get(kso, &ksb, 8, 0, "units") < 0 || get(vso, &vsb, 8, 0, "values") < 0)
        goto done;
    Py_ssize_t n = N(kb, uint32_t), m = N(ksb, int64_t);
    if (n == 0 || (n & (n - 1)) || N(vb, uint32_t) != n || N(vsb, int64_t) != m) {
        PyErr_SetString(PyExc_ValueError, "live map: keys and vals of one power-of-two size, "
                                          "units and values of one length");
        goto done;
    }
    uint32_t *keys = kb.b.buf, *vals = vb.b.buf;
    const int64_t *ks = ksb.b.buf, *vs = vsb.b.buf;
    long long added = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        if (ks[i] < 0 || ks[i] >= (int64_t)LM_TOMB - 1 || vs[i] < 0 || vs[i] > 0xFFFFFFFFLL) {
            PyErr_Format(PyExc_ValueError, "live map: entry %zd out of range", i);
            goto done;
        }
        Py_ssize_t free_at;
        Py_ssize_t at = lm_find(keys, n, (uint32_t)(ks[i] + 1), &free_at);
        if (at >= 0) {
            vals[at] = (uint32_t)vs[i];
        } else if (free_at >= 0) {
            keys[free_at] = (uint32_t)(ks[i] + 1);
            vals[free_at] = (uint32_t)vs[i];
            added++;
        } else {
            PyErr_SetString(PyExc_ValueError, "live map: no free slot");
            goto done;
        }
    }
    res = PyLong_FromLongLong(added);
done:
    put(&kb); put(&vb); put(&ksb); put(&vsb);
    return res;
}

static PyObject *py_live_get_many(PyObject *self, PyObject *args) {
    PyObject *ko, *vo, *kso, *outo;
    if (!PyArg_ParseTuple(args, "OOOO", &ko, &vo, &kso, &outo)) return NULL;
    buf_t kb = {0}, vb = {0}, ksb = {0}, ob = {0};
    PyObject *res = NULL;
    if (get(ko, &kb, 4, 0, "keys") < 0 || get(vo, &vb, 4, 0, "vals") < 0 ||
        get(kso, &ksb, 8, 0, "units") < 0 || get(outo, &ob, 8, 1, "out") < 0)
        goto done;
    Py_ssize_t n = N(kb, uint32_t), m = N(ksb, int64_t);
    if (n == 0 || (n & (n - 1)) || N(vb, uint32_t) != n || N(ob, int64_t) != m) {
        PyErr_SetString(PyExc_ValueError, "live map: keys and vals of one power-of-two size, "
                                          "units and out of one length");
        goto done;
    }
    const uint32_t *keys = kb.b.buf, *vals = vb.b.buf;
    const int64_t *ks = ksb.b.buf;
    int64_t *out = ob.b.buf;
    long long found = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        Py_ssize_t free_at, at = -1;
        if (ks[i] >= 0 && ks[i] < (int64_t)LM_TOMB - 1)
            at = lm_find(keys, n, (uint32_t)(ks[i] + 1), &free_at);
        out[i] = at >= 0 ? (int64_t)vals[at] : -1;
        found += at >= 0;
    }
    res = PyLong_FromLongLong(found);
done:
    put(&kb); put(&vb); put(&ksb); put(&ob);
    return res;
}

static PyObject *py_key_find_cols(PyObject *self, PyObject *args) {
    PyObject *to, *k0o, *k1o, *nso, *q0o, *q1o, *outo;
    int nsid;
    if (!PyArg_ParseTuple(args, "OOOOOOiO", &to, &k0o, &k1o, &nso, &q0o, &q1o, &nsid, &outo))
        return NULL;
    buf_t tb = {0}, k0b = {0}, k1b = {0}, nsb = {0}, q0b = {0}, q1b = {0}, ob = {0};
    keymap_t m;
    PyObject *res = NULL;
    if (keymap_get(&m, &tb, &k0b, &k1b, &nsb, to, k0o, k1o, nso) < 0 ||
        get(q0o, &q0b, 8, 0, "keys k0") < 0 || get(q1o, &q1b, 8, 0, "keys k1") < 0 ||
        get(outo, &ob, 4, 1, "out") < 0)
        goto done;
    Py_ssize_t n = N(q0b, uint64_t);
    if (N(q1b, uint64_t) != n || N(ob, int32_t) != n) {
        PyErr_SetString(PyExc_ValueError, "k0, k1 and out of one length");
        goto done;
    }
    const uint64_t *q0 = q0b.b.buf, *q1 = q1b.b.buf;
    int32_t *out = ob.b.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t r = find1(&m, q0[i], q1[i], (uint16_t)nsid);
        if (r == -3) { res = oob("table entry", r); goto done; }
        out[i] = r;
    }
    res = Py_None;
    Py_INCREF(res);
done:
    put(&tb); put(&k0b); put(&k1b); put(&nsb); put(&q0b); put(&q1b); put(&ob);
    return res;
}

static PyObject *py_key_place(PyObject *self, PyObject *args) {
    PyObject *to, *k0o, *nso, *ido;
    if (!PyArg_ParseTuple(args, "OOOO", &to, &k0o, &nso, &ido)) return NULL;
    buf_t tb = {0}, k0b = {0}, nsb = {0}, ib = {0};
    PyObject *res = NULL;
    if (get(to, &tb, 4, 1, "table") < 0 || get(k0o, &k0b, 8, 0, "k0") < 0 ||
        get(nso, &nsb, 2, 0, "ns") < 0 || get(ido, &ib, 4, 0, "ids") < 0)
        goto done;
    Py_ssize_t nslots = N(tb, int32_t), nb = N(k0b, uint64_t), m = N(ib, int32_t);
    if (N(nsb, uint16_t) < nb) nb = N(nsb, uint16_t);
    if (nslots == 0 || (nslots & (nslots - 1))) {
        PyErr_SetString(PyExc_ValueError, "table: size must be a power of two");
        goto done;
    }
    int32_t *table = tb.b.buf;
    const uint64_t *k0 = k0b.b.buf;
    const uint16_t *ns = nsb.b.buf;
    const int32_t *ids = ib.b.buf;
    uint64_t mask = (uint64_t)nslots - 1;
    long long reused = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        int32_t id = ids[i];
        if (id < 0 || id >= nb) { res = oob("block", id); goto done; }
        uint64_t h = (k0[id] ^ ((uint64_t)ns[id] * MIX)) & mask;
        Py_ssize_t probes = 0;
        while (table[h] >= 0) {
            if (++probes >= nslots) {
                PyErr_SetString(PyExc_ValueError, "key map: no free slot");
                goto done;
            }
            h = (h + 1) & mask;
        }
        reused += table[h] != EMPTY; /* a tombstone taken */
        table[h] = id;
    }
    res = PyLong_FromLongLong(reused);
done:
    put(&tb); put(&k0b); put(&nsb); put(&ib);
    return res;
}

static PyMethodDef methods[] = {
    {"heap_sift", py_heap_sift, METH_VARARGS,
     "heap_sift(heap, tick, seq, hpos, size, i) -> int: restore the heap order around i."},
    {"key_find1", py_key_find1, METH_VARARGS,
     "key_find1(table, k0, k1, ns, key, nsid) -> int: one key's block id, or -1."},
    {"key_find_list", py_key_find_list, METH_VARARGS,
     "key_find_list(table, k0, k1, ns, keys, nsid, out) -> None: each key's block id (-1: "
     "absent) into out."},
    {"key_prefix", py_key_prefix, METH_VARARGS,
     "key_prefix(table, k0, k1, ns, obj, groups, nsid, keys, full) -> list: the block ids "
     "of the leading keys indexed (and holding an object of group full, if full >= 0)."},
    {"key_slot", py_key_slot, METH_VARARGS,
     "key_slot(table, k0, ns, bid) -> int: the table slot holding block bid, or -1."},
    {"match", py_match, METH_VARARGS,
     "match(table, k0, k1, ns, obj, groups, nsid, keys, group) -> int: how many leading "
     "keys have an object of group (binary search of probes)."},
    {"live_get", py_live_get, METH_VARARGS,
     "live_get(keys, vals, k) -> int: the live map's value of k, or -1."},
    {"live_put", py_live_put, METH_VARARGS,
     "live_put(keys, vals, k, v) -> int: 1 added, 0 replaced, -1 no free slot."},
    {"live_put_many", py_live_put_many, METH_VARARGS,
     "live_put_many(keys, vals, units, values) -> int: put each (int64 arrays); the "
     "count added."},
    {"live_pop", py_live_pop, METH_VARARGS,
     "live_pop(keys, vals, k) -> int: remove k, answering its value, or -1."},
    {"key_place", py_key_place, METH_VARARGS,
     "key_place(table, k0, ns, ids) -> int: put each block id into the table (its key not "
     "there); the tombstones taken."},
    {"live_get_many", py_live_get_many, METH_VARARGS,
     "live_get_many(keys, vals, units, out) -> int: each unit's value (-1: absent) into the "
     "int64 out; the count found."},
    {"key_find_cols", py_key_find_cols, METH_VARARGS,
     "key_find_cols(table, k0, k1, ns, q0, q1, nsid, out) -> None: the block id of each key "
     "given as two uint64 columns (-1: absent) into out."},
    {"lease_rows", gc_lease_rows, METH_VARARGS,
     "lease_rows(rows, tick, atime, pins, block, tick_col, atime_col, hpos, hseq, tier, "
     "server, offset, length, group, sums_len, sums_slot, pos, slabs, heap0, size0, seq0, "
     "heap1, size1, seq1) -> (fields, seq0, seq1): a small lease's rows pinned, touched and "
     "read in one pass."},
    {"unpin_rows", gc_unpin_rows, METH_VARARGS,
     "unpin_rows(rows, pins, block, hpos, group, tier, ns, hot, children, full) -> list: "
     "each row's pin taken back; the rows left for the caller (detached, or evictable and "
     "out of their heap)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_index", "GCache compact index kernels.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__index(void) { return PyModule_Create(&moduledef); }
