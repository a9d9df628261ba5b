/* kvhal.tiers.fs._chunkio: one chunk file written or read in a single GIL-free call.
 *
 * The fs tier's Python path (fileio.py) makes four or five system calls per chunk (open,
 * pwritev/preadv, fstat, close, rename), and each one hands the GIL back and forth; with 16+16
 * tier threads on a few cores those handoffs, not the disk, bound throughput (profiled in issue
 * 13). These two functions make the same calls, in the same order and with the same flags, with
 * the GIL released once around all of them. fileio.py stays the single description of the
 * file format and its checks; this module only moves bytes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#ifndef O_DIRECT
#define O_DIRECT 0
#endif

#define MAX_BUFS 4

/* XXH3_128bits(input, length) of the xxHash library, as python-xxhash's extension exports it
 * (bound at import by fileio.py, which checks it against xxhash.xxh3_128_digest first). */
typedef struct {
    uint64_t low64;
    uint64_t high64;
} xxh128_hash;
typedef xxh128_hash (*xxh128_fn)(const void *, size_t);
typedef uint64_t (*xxh64_fn)(const void *, size_t);
static xxh128_fn hasher = NULL;
/* XXH3_64bits(input, length), bound with it: the header digest of a sealed write. */
static xxh64_fn hasher64 = NULL;

/* The canonical (big-endian, high half first) 16-byte form xxhash.xxh3_128_digest returns. */
static void canonical(xxh128_hash h, unsigned char out[16]) {
    for (int i = 0; i < 8; i++) {
        out[i] = (unsigned char)(h.high64 >> (56 - 8 * i));
        out[8 + i] = (unsigned char)(h.low64 >> (56 - 8 * i));
    }
}

/* Buffers of a Python sequence of at most MAX_BUFS writable (or readable) buffer objects.
 * Empty buffers are skipped. Returns the count, or -1 with a Python exception set. */
static int get_buffers(PyObject *seq, Py_buffer *views, struct iovec *iov, int writable) {
    PyObject *fast = PySequence_Fast(seq, "bufs must be a sequence of buffers");
    if (fast == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n > MAX_BUFS) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "bufs: at most %d buffers, got %zd", MAX_BUFS, n);
        return -1;
    }
    int count = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_buffer *view = &views[count];
        int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, i), view, flags) < 0) {
            for (int j = 0; j < count; j++) PyBuffer_Release(&views[j]);
            Py_DECREF(fast);
            return -1;
        }
        if (view->len == 0) {
            PyBuffer_Release(view);
            continue;
        }
        iov[count].iov_base = view->buf;
        iov[count].iov_len = (size_t)view->len;
        count++;
    }
    Py_DECREF(fast);
    return count;
}

static void release_buffers(Py_buffer *views, int count) {
    for (int i = 0; i < count; i++) PyBuffer_Release(&views[i]);
}

/* Advance iov past n bytes; returns the new count of iovecs left (iov is compacted). */
static int advance(struct iovec *iov, int count, size_t n) {
    int i = 0;
    while (i < count && n >= iov[i].iov_len) {
        n -= iov[i].iov_len;
        i++;
    }
    if (i < count && n) {
        iov[i].iov_base = (char *)iov[i].iov_base + n;
        iov[i].iov_len -= n;
    }
    for (int j = i; j < count; j++) iov[j - i] = iov[j];
    return count - i;
}

static PyObject *raise_errno(int err, const char *step, PyObject *path) {
    PyObject *exc = PyObject_CallFunction(PyExc_OSError, "isO", err, strerror(err), path);
    if (exc == NULL) return NULL;
    PyObject *note = PyUnicode_FromString(step);
    if (note != NULL) {
        PyObject_SetAttrString(exc, "kvhal_step", note);
        Py_DECREF(note);
    }
    PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_DECREF(exc);
    return NULL;
}

PyDoc_STRVAR(write_file_doc,
"write_file(tmp, final, bufs, direct, sync, folder, checksum_at=-1, digest_at=-1, reuse=None)\n"
"    -> bool\n\n"
"Create `tmp` (O_WRONLY|O_CREAT|O_EXCL|O_CLOEXEC, plus O_DIRECT if `direct`, mode 0644), write\n"
"the buffers in `bufs` (at most 4, in order, from offset 0; short writes are continued), with\n"
"`sync` fdatasync it, close it and rename it to `final`; with `sync` also fsync the folder\n"
"`folder` afterwards. The GIL is released for all of it. On any error `tmp` is unlinked.\n\n"
"Recycling (`reuse` a path): the file at `reuse` (an evicted chunk file), if it is a regular\n"
"file with one link, gets the current mtime, is renamed to `tmp` and overwritten in place\n"
"(opened O_NOFOLLOW|O_NONBLOCK without O_CREAT and checked again, truncated to the bytes\n"
"written), so no inode or block is allocated. Otherwise, or if a step fails, `reuse` (or what\n"
"took `tmp`) is unlinked (best effort) and `tmp` created as above. Returns True if `reuse`\n"
"was recycled, False if `tmp` was created.\n\n"
"Sealing (`checksum_at` >= 0; both hashers bound, `set_hasher`): before anything is written,\n"
"the canonical 16-byte xxh3-128 of `bufs[1]` is stored at byte `checksum_at` of `bufs[0]`,\n"
"then the little-endian xxh3-64 of `bufs[0][:digest_at]` at byte `digest_at` (the header\n"
"block of tiers/chunk_format.py, whose `encode_header_fields` returns those offsets).\n"
"`bufs[0]` must then be writable.\n\n"
"Raises:\n"
"    OSError: errno and `tmp` (or `folder`) of the failing step; its `kvhal_step` attribute\n"
"        names the step (open, pwritev, ftruncate, fdatasync, close, rename, fsync_dir).\n"
"    ValueError: more than 4 buffers; sealing asked without both hashers bound, with an\n"
"        empty buffer or fewer than 2, or with offsets outside `bufs[0]`.\n"
"    BufferError: sealing with a read-only `bufs[0]`.");

static PyObject *write_file(PyObject *self, PyObject *args) {
    PyObject *tmp_arg, *final_arg, *folder_arg, *bufs, *reuse_arg = Py_None;
    PyObject *tmp_obj = NULL, *final_obj = NULL, *folder_obj = NULL, *reuse_obj = NULL;
    int direct, sync;
    Py_ssize_t checksum_at = -1, digest_at = -1;
    if (!PyArg_ParseTuple(args, "OOOppO|nnO", &tmp_arg, &final_arg, &bufs, &direct, &sync,
                          &folder_arg, &checksum_at, &digest_at, &reuse_arg))
        return NULL;
    if (reuse_arg != Py_None && !PyUnicode_FSConverter(reuse_arg, &reuse_obj))
        return NULL;
    int seal = checksum_at >= 0;
    if (seal && (hasher == NULL || hasher64 == NULL)) {
        PyErr_SetString(PyExc_ValueError, "checksum_at: sealing needs both hashers bound");
        return NULL;
    }
    if (!PyUnicode_FSConverter(tmp_arg, &tmp_obj) || !PyUnicode_FSConverter(final_arg, &final_obj)
        || !PyUnicode_FSConverter(folder_arg, &folder_obj)) {
        Py_XDECREF(tmp_obj);
        Py_XDECREF(final_obj);
        Py_XDECREF(reuse_obj);
        return NULL;
    }
    Py_buffer views[MAX_BUFS];
    struct iovec iov[MAX_BUFS];
    PyObject *result = NULL;
    Py_ssize_t given = seal ? PyObject_Length(bufs) : 0;
    if (given < 0) goto out;
    int count = get_buffers(bufs, views, iov, seal);
    if (count < 0) goto out;
    /* sealing writes into bufs[0] and hashes bufs[1]: both must be there and non-empty (an
     * empty buffer is skipped, which would shift iov[0] onto another buffer); the offsets are
     * compared by subtraction, so huge values cannot overflow past the check */
    Py_ssize_t header_len = count ? (Py_ssize_t)iov[0].iov_len : 0;
    if (seal && (count < 2 || count != given || checksum_at > header_len - 16 || digest_at < 0
                 || digest_at > header_len - 8)) {
        PyErr_Format(PyExc_ValueError, "checksum_at=%zd, digest_at=%zd: outside a header of "
                     "%zd bytes, or an empty or missing header or payload buffer", checksum_at,
                     digest_at, header_len);
        release_buffers(views, count);
        goto out;
    }
    const char *tmp = PyBytes_AS_STRING(tmp_obj);
    const char *final = PyBytes_AS_STRING(final_obj);
    const char *folder = PyBytes_AS_STRING(folder_obj);
    const char *step = NULL;
    int err = 0, failed_on_folder = 0, reused = 0;
    Py_BEGIN_ALLOW_THREADS
    if (seal) {
        unsigned char *header = (unsigned char *)iov[0].iov_base;
        canonical(hasher(iov[1].iov_base, iov[1].iov_len), header + checksum_at);
        uint64_t digest = hasher64(header, (size_t)digest_at);
        for (int i = 0; i < 8; i++) header[digest_at + i] = (unsigned char)(digest >> (8 * i));
    }
    int flags = O_WRONLY | O_CLOEXEC | (direct ? O_DIRECT : 0);
    int fd = -1;
    if (reuse_obj != NULL) {
        /* only a regular file with no other name (a symlink's target or a hard link's other
         * name lies outside the tier); its mtime is made fresh before it takes the temp name,
         * so that no scan takes it for a dead writer's old temp file */
        const char *reuse = PyBytes_AS_STRING(reuse_obj);
        struct stat st;
        if (lstat(reuse, &st) == 0 && S_ISREG(st.st_mode) && st.st_nlink == 1
            && utimensat(AT_FDCWD, reuse, NULL, AT_SYMLINK_NOFOLLOW) == 0
            && rename(reuse, tmp) == 0) {
            /* O_NOFOLLOW|O_NONBLOCK: whatever took its place meanwhile never blocks the open
             * (a FIFO) nor leads out of the folder; checked again, then O_NONBLOCK cleared */
            fd = open(tmp, flags | O_NOFOLLOW | O_NONBLOCK);
            if (fd >= 0 && (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_nlink != 1
                            || fcntl(fd, F_SETFL, direct ? O_DIRECT : 0) != 0)) {
                close(fd);
                fd = -1;
            }
            reused = fd >= 0;
            if (fd < 0) unlink(tmp);
        } else {
            unlink(reuse);
        }
    }
    if (fd < 0) fd = open(tmp, flags | O_CREAT | O_EXCL, 0644);
    if (fd < 0) {
        err = errno;
        step = "open";
    } else {
        off_t offset = 0;
        struct iovec *cur = iov;
        int left = count;
        while (left > 0) {
            ssize_t n = pwritev(fd, cur, left, offset);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) {
                err = n < 0 ? errno : EIO;
                step = "pwritev";
                break;
            }
            offset += n;
            left = advance(cur, left, (size_t)n);
        }
        if (!err && reused && ftruncate(fd, offset) != 0) {
            err = errno;
            step = "ftruncate";
        }
        if (!err && sync && fdatasync(fd) != 0) {
            err = errno;
            step = "fdatasync";
        }
        if (close(fd) != 0 && !err) {
            err = errno;
            step = "close";
        }
        if (!err && rename(tmp, final) != 0) {
            err = errno;
            step = "rename";
        }
        if (err) unlink(tmp);
        if (!err && sync) {
            int dfd = open(folder, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
            if (dfd < 0 || fsync(dfd) != 0) {
                err = errno;
                step = "fsync_dir";
                failed_on_folder = 1;
            }
            if (dfd >= 0) close(dfd);
        }
    }
    Py_END_ALLOW_THREADS
    if (err) {
        raise_errno(err, step, failed_on_folder ? folder_arg : tmp_arg);
    } else {
        result = PyBool_FromLong(reused);
    }
    release_buffers(views, count);
out:
    Py_DECREF(tmp_obj);
    Py_DECREF(final_obj);
    Py_DECREF(folder_obj);
    Py_XDECREF(reuse_obj);
    return result;
}

PyDoc_STRVAR(read_file_doc,
"read_file(path, bufs, direct, expected, verify=-1) -> (status, value, digest, file_id)\n\n"
"Open `path` (O_RDONLY|O_CLOEXEC|O_NONBLOCK, plus O_DIRECT if `direct`), fstat it and, when it\n"
"is a regular file of exactly `expected` bytes, preadv it from offset 0 into the writable\n"
"buffers `bufs` (at most 4, in order; one call, as the Python path does). The GIL is released\n"
"for all of it. Returns (0, bytes read), (1, st_mode) for a file that is not regular, or\n"
"(2, size) for a regular file of another size (nothing read). `digest` is the 16-byte\n"
"xxh3-128 of `bufs[verify]` after a complete read, computed without the GIL, when\n"
"`verify` >= 0 and a hasher is bound (`set_hasher`); else None. `file_id` is the opened\n"
"file's (st_dev, st_ino, st_ctime_ns) from that fstat.\n\n"
"Raises:\n"
"    OSError: errno and `path` of the failing open, fstat or preadv (ENOENT, EACCES, EIO...).\n"
"    ValueError: more than 4 buffers.");

static PyObject *read_file(PyObject *self, PyObject *args) {
    PyObject *path_arg, *path_obj = NULL, *bufs;
    int direct, verify = -1;
    long long expected;
    if (!PyArg_ParseTuple(args, "OOpL|i", &path_arg, &bufs, &direct, &expected, &verify))
        return NULL;
    if (!PyUnicode_FSConverter(path_arg, &path_obj)) return NULL;
    Py_buffer views[MAX_BUFS];
    struct iovec iov[MAX_BUFS];
    PyObject *result = NULL;
    int count = get_buffers(bufs, views, iov, 1);
    if (count < 0) goto out;
    const char *path = PyBytes_AS_STRING(path_obj);
    const char *step = NULL;
    int err = 0, status = 0, hashed = 0;
    long long value = 0, dev = 0, ino = 0, ctime_ns = 0;
    unsigned char digest[16];
    xxh128_fn hash = hasher;
    if (verify >= count) verify = -1;
    Py_BEGIN_ALLOW_THREADS
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | (direct ? O_DIRECT : 0));
    if (fd < 0) {
        err = errno;
        step = "open";
    } else {
        struct stat st;
        int stated = fstat(fd, &st) == 0;
        if (stated) {
            dev = (long long)st.st_dev;
            ino = (long long)st.st_ino;
            ctime_ns = (long long)st.st_ctim.tv_sec * 1000000000LL + st.st_ctim.tv_nsec;
        }
        if (!stated) {
            err = errno;
            step = "fstat";
        } else if (!S_ISREG(st.st_mode)) {
            status = 1;
            value = (long long)st.st_mode;
        } else if ((long long)st.st_size != expected) {
            status = 2;
            value = (long long)st.st_size;
        } else {
            ssize_t n;
            do {
                n = preadv(fd, iov, count, 0);
            } while (n < 0 && errno == EINTR);
            if (n < 0) {
                err = errno;
                step = "preadv";
            } else {
                value = (long long)n;
                if (n == expected && verify >= 0 && hash != NULL) {
                    canonical(hash(iov[verify].iov_base, iov[verify].iov_len), digest);
                    hashed = 1;
                }
            }
        }
        close(fd);
    }
    Py_END_ALLOW_THREADS
    if (err)
        raise_errno(err, step, path_arg);
    else if (hashed)
        result = Py_BuildValue("iLy#(LLL)", status, value, (const char *)digest,
                               (Py_ssize_t)16, dev, ino, ctime_ns);
    else
        result = Py_BuildValue("iLO(LLL)", status, value, Py_None, dev, ino, ctime_ns);
    release_buffers(views, count);
out:
    Py_DECREF(path_obj);
    return result;
}

PyDoc_STRVAR(set_hasher_doc,
"set_hasher(address, address64=0) -> None\n\n"
"Bind the addresses of XXH3_128bits and XXH3_64bits (const void *, size_t) (0 unbinds). The\n"
"caller vouches for them; fileio.py takes them from python-xxhash and checks them with\n"
"`xxh3_128` and `xxh3_64`.");

static PyObject *set_hasher(PyObject *self, PyObject *args) {
    unsigned long long address, address64 = 0;
    if (!PyArg_ParseTuple(args, "K|K", &address, &address64)) return NULL;
    hasher = (xxh128_fn)(uintptr_t)address;
    hasher64 = (xxh64_fn)(uintptr_t)address64;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(xxh3_128_doc,
"xxh3_128(buf) -> bytes | None\n\n"
"The 16-byte xxh3-128 digest of `buf` by the bound hasher (GIL held), or None if unbound.");

static PyObject *xxh3_128(PyObject *self, PyObject *args) {
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "y*", &view)) return NULL;
    xxh128_fn hash = hasher;
    if (hash == NULL) {
        PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    unsigned char digest[16];
    canonical(hash(view.buf, (size_t)view.len), digest);
    PyBuffer_Release(&view);
    return PyBytes_FromStringAndSize((const char *)digest, 16);
}

PyDoc_STRVAR(xxh3_64_doc,
"xxh3_64(buf) -> int | None\n\n"
"The xxh3-64 digest of `buf` by the bound 64-bit hasher (GIL held), or None if unbound.");

static PyObject *xxh3_64(PyObject *self, PyObject *args) {
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "y*", &view)) return NULL;
    xxh64_fn hash = hasher64;
    if (hash == NULL) {
        PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    uint64_t digest = hash(view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(digest);
}

static PyMethodDef methods[] = {
    {"xxh3_64", xxh3_64, METH_VARARGS, xxh3_64_doc},
    {"set_hasher", set_hasher, METH_VARARGS, set_hasher_doc},
    {"xxh3_128", xxh3_128, METH_VARARGS, xxh3_128_doc},
    {"write_file", write_file, METH_VARARGS, write_file_doc},
    {"read_file", read_file, METH_VARARGS, read_file_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_chunkio",
    "One chunk file written or read in a single GIL-free call (see fileio.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__chunkio(void) { return PyModule_Create(&module); }
