/* kvhal.tiers.fs._chunkio: one chunk file (or a batch of them) written or read in a single
 * GIL-free call.
 *
 * The fs tier's Python path (fileio.py) makes four or five system calls per chunk (open,
 * pwritev/preadv, fstat, close, rename), and each one hands the GIL back and forth; with 16+16
 * tier threads on a few cores those handoffs, not the disk, bound throughput (profiled in issue
 * 13). `write_file` and `read_file` make the same calls, in the same order and with the same
 * flags, with the GIL released once around all of them; `write_files` and `read_files` do that
 * for a batch of chunks, one GIL release per batch (a pool thread takes a batch while more jobs
 * than threads are queued: `tiers/jobs.py` LanePool). fileio.py stays the single description
 * of the file format and its checks; this module only moves bytes.
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

/* An OSError(err, strerror(err), path) with its `kvhal_step` attribute naming the step; NULL
 * with a Python exception set if it cannot be built. */
static PyObject *errno_error(int err, const char *step, PyObject *path) {
    PyObject *exc = PyObject_CallFunction(PyExc_OSError, "isO", err, strerror(err), path);
    if (exc == NULL) return NULL;
    PyObject *note = PyUnicode_FromString(step);
    if (note == NULL || PyObject_SetAttrString(exc, "kvhal_step", note) < 0) {
        Py_XDECREF(note);
        Py_DECREF(exc);
        return NULL;
    }
    Py_DECREF(note);
    return exc;
}

/* One chunk file to write: the arguments of `write_file`, converted, and its outcome. */
struct write_job {
    PyObject *tmp_arg, *folder_arg;                      /* borrowed, for errors */
    PyObject *tmp_obj, *final_obj, *folder_obj, *reuse_obj; /* owned bytes (reuse: or NULL) */
    Py_buffer views[MAX_BUFS];
    struct iovec iov[MAX_BUFS];
    int count, direct, sync, seal;
    Py_ssize_t checksum_at, digest_at;
    /* outcome */
    int err, failed_on_folder, reused;
    const char *step;
};

static void write_job_release(struct write_job *j) {
    release_buffers(j->views, j->count);
    j->count = 0;
    Py_CLEAR(j->tmp_obj);
    Py_CLEAR(j->final_obj);
    Py_CLEAR(j->folder_obj);
    Py_CLEAR(j->reuse_obj);
}

/* Convert `write_file`'s argument tuple into `j` (zeroed by the caller). Returns 0, or -1 with a
 * Python exception set and nothing held. */
static int write_job_parse(PyObject *args, struct write_job *j) {
    PyObject *final_arg, *bufs, *reuse_arg = Py_None;
    j->checksum_at = j->digest_at = -1;
    if (!PyArg_ParseTuple(args, "OOOppO|nnO", &j->tmp_arg, &final_arg, &bufs, &j->direct,
                          &j->sync, &j->folder_arg, &j->checksum_at, &j->digest_at, &reuse_arg))
        return -1;
    j->seal = j->checksum_at >= 0;
    if (j->seal && (hasher == NULL || hasher64 == NULL)) {
        PyErr_SetString(PyExc_ValueError, "checksum_at: sealing needs both hashers bound");
        return -1;
    }
    if ((reuse_arg != Py_None && !PyUnicode_FSConverter(reuse_arg, &j->reuse_obj))
        || !PyUnicode_FSConverter(j->tmp_arg, &j->tmp_obj)
        || !PyUnicode_FSConverter(final_arg, &j->final_obj)
        || !PyUnicode_FSConverter(j->folder_arg, &j->folder_obj)) {
        write_job_release(j);
        return -1;
    }
    Py_ssize_t given = j->seal ? PyObject_Length(bufs) : 0;
    int count = given < 0 ? -1 : get_buffers(bufs, j->views, j->iov, j->seal);
    if (count < 0) {
        write_job_release(j);
        return -1;
    }
    j->count = count;
    /* sealing writes into bufs[0] and hashes bufs[1]: both must be there and non-empty (an
     * empty buffer is skipped, which would shift iov[0] onto another buffer); the offsets are
     * compared by subtraction, so huge values cannot overflow past the check */
    Py_ssize_t header_len = count ? (Py_ssize_t)j->iov[0].iov_len : 0;
    if (j->seal && (count < 2 || count != given || j->checksum_at > header_len - 16
                    || j->digest_at < 0 || j->digest_at > header_len - 8)) {
        PyErr_Format(PyExc_ValueError, "checksum_at=%zd, digest_at=%zd: outside a header of "
                     "%zd bytes, or an empty or missing header or payload buffer",
                     j->checksum_at, j->digest_at, header_len);
        write_job_release(j);
        return -1;
    }
    return 0;
}

/* The system calls of one write (see write_file_doc); runs without the GIL. */
static void write_job_run(struct write_job *j) {
    const char *tmp = PyBytes_AS_STRING(j->tmp_obj);
    const char *final = PyBytes_AS_STRING(j->final_obj);
    const char *folder = PyBytes_AS_STRING(j->folder_obj);
    struct iovec *iov = j->iov;
    if (j->seal) {
        unsigned char *header = (unsigned char *)iov[0].iov_base;
        canonical(hasher(iov[1].iov_base, iov[1].iov_len), header + j->checksum_at);
        uint64_t digest = hasher64(header, (size_t)j->digest_at);
        for (int i = 0; i < 8; i++) header[j->digest_at + i] = (unsigned char)(digest >> (8 * i));
    }
    int flags = O_WRONLY | O_CLOEXEC | (j->direct ? O_DIRECT : 0);
    int fd = -1;
    if (j->reuse_obj != NULL) {
        /* only a regular file with no other name (a symlink's target or a hard link's other
         * name lies outside the tier); its mtime is made fresh before it takes the temp name,
         * so that no scan takes it for a dead writer's old temp file */
        const char *reuse = PyBytes_AS_STRING(j->reuse_obj);
        struct stat st;
        if (lstat(reuse, &st) == 0 && S_ISREG(st.st_mode) && st.st_nlink == 1
            && utimensat(AT_FDCWD, reuse, NULL, AT_SYMLINK_NOFOLLOW) == 0
            && rename(reuse, tmp) == 0) {
            /* O_NOFOLLOW|O_NONBLOCK: whatever took its place meanwhile never blocks the open
             * (a FIFO) nor leads out of the folder; checked again, then O_NONBLOCK cleared */
            fd = open(tmp, flags | O_NOFOLLOW | O_NONBLOCK);
            if (fd >= 0 && (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_nlink != 1
                            || fcntl(fd, F_SETFL, j->direct ? O_DIRECT : 0) != 0)) {
                close(fd);
                fd = -1;
            }
            j->reused = fd >= 0;
            if (fd < 0) unlink(tmp);
        } else {
            unlink(reuse);
        }
    }
    if (fd < 0) fd = open(tmp, flags | O_CREAT | O_EXCL, 0644);
    if (fd < 0) {
        j->err = errno;
        j->step = "open";
        return;
    }
    off_t offset = 0;
    struct iovec *cur = iov;
    int left = j->count;
    while (left > 0) {
        ssize_t n = pwritev(fd, cur, left, offset);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            j->err = n < 0 ? errno : EIO;
            j->step = "pwritev";
            break;
        }
        offset += n;
        left = advance(cur, left, (size_t)n);
    }
    if (!j->err && j->reused && ftruncate(fd, offset) != 0) {
        j->err = errno;
        j->step = "ftruncate";
    }
    if (!j->err && j->sync && fdatasync(fd) != 0) {
        j->err = errno;
        j->step = "fdatasync";
    }
    if (close(fd) != 0 && !j->err) {
        j->err = errno;
        j->step = "close";
    }
    if (!j->err && rename(tmp, final) != 0) {
        j->err = errno;
        j->step = "rename";
    }
    if (j->err) unlink(tmp);
    if (!j->err && j->sync) {
        int dfd = open(folder, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (dfd < 0 || fsync(dfd) != 0) {
            j->err = errno;
            j->step = "fsync_dir";
            j->failed_on_folder = 1;
        }
        if (dfd >= 0) close(dfd);
    }
}

/* The outcome of a write that ran: True/False (recycled), or its OSError (NULL: an exception
 * is set). */
static PyObject *write_job_outcome(struct write_job *j) {
    if (j->err)
        return errno_error(j->err, j->step, j->failed_on_folder ? j->folder_arg : j->tmp_arg);
    return PyBool_FromLong(j->reused);
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

static PyObject *single(PyObject *args, int kind);

static PyObject *write_file(PyObject *self, PyObject *args) { return single(args, 1); }

/* One chunk file to read: the arguments of `read_file`, converted, and its outcome. */
struct read_job {
    PyObject *path_arg;  /* borrowed, for errors */
    PyObject *path_obj;  /* owned bytes */
    Py_buffer views[MAX_BUFS];
    struct iovec iov[MAX_BUFS];
    int count, direct, verify;
    long long expected;
    /* outcome */
    int err, status, hashed;
    const char *step;
    long long value, dev, ino, ctime_ns;
    unsigned char digest[16];
};

static void read_job_release(struct read_job *j) {
    release_buffers(j->views, j->count);
    j->count = 0;
    Py_CLEAR(j->path_obj);
}

/* Convert `read_file`'s argument tuple into `j` (zeroed by the caller). Returns 0, or -1 with a
 * Python exception set and nothing held. */
static int read_job_parse(PyObject *args, struct read_job *j) {
    PyObject *bufs;
    j->verify = -1;
    if (!PyArg_ParseTuple(args, "OOpL|i", &j->path_arg, &bufs, &j->direct, &j->expected,
                          &j->verify))
        return -1;
    if (!PyUnicode_FSConverter(j->path_arg, &j->path_obj)) return -1;
    int count = get_buffers(bufs, j->views, j->iov, 1);
    if (count < 0) {
        read_job_release(j);
        return -1;
    }
    j->count = count;
    if (j->verify >= count) j->verify = -1;
    return 0;
}

/* The system calls of one read, and its checksum (see read_file_doc); runs without the GIL. */
static void read_job_run(struct read_job *j, xxh128_fn hash) {
    const char *path = PyBytes_AS_STRING(j->path_obj);
    int flags = O_RDONLY | O_CLOEXEC | O_NONBLOCK;
    int fd = open(path, flags | (j->direct ? O_DIRECT : 0));
    /* O_DIRECT refuses a FIFO or a directory (EINVAL): opened without it, fstat says what
     * took the chunk's name (then quarantined, not an I/O error forever) */
    if (fd < 0 && errno == EINVAL && j->direct) fd = open(path, flags);
    if (fd < 0) {
        j->err = errno;
        j->step = "open";
        return;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        j->err = errno;
        j->step = "fstat";
    } else {
        j->dev = (long long)st.st_dev;
        j->ino = (long long)st.st_ino;
        j->ctime_ns = (long long)st.st_ctim.tv_sec * 1000000000LL + st.st_ctim.tv_nsec;
        if (!S_ISREG(st.st_mode)) {
            j->status = 1;
            j->value = (long long)st.st_mode;
        } else if ((long long)st.st_size != j->expected) {
            j->status = 2;
            j->value = (long long)st.st_size;
        } else {
            ssize_t n;
            do {
                n = preadv(fd, j->iov, j->count, 0);
            } while (n < 0 && errno == EINTR);
            if (n < 0) {
                j->err = errno;
                j->step = "preadv";
            } else {
                j->value = (long long)n;
                if (n == j->expected && j->verify >= 0 && hash != NULL) {
                    canonical(hash(j->iov[j->verify].iov_base, j->iov[j->verify].iov_len),
                              j->digest);
                    j->hashed = 1;
                }
            }
        }
    }
    close(fd);
}

/* The outcome of a read that ran: (status, value, digest, file_id), or its OSError (NULL: an
 * exception is set). */
static PyObject *read_job_outcome(struct read_job *j) {
    if (j->err) return errno_error(j->err, j->step, j->path_arg);
    if (j->hashed)
        return Py_BuildValue("iLy#(LLL)", j->status, j->value, (const char *)j->digest,
                             (Py_ssize_t)16, j->dev, j->ino, j->ctime_ns);
    return Py_BuildValue("iLO(LLL)", j->status, j->value, Py_None, j->dev, j->ino, j->ctime_ns);
}

PyDoc_STRVAR(read_file_doc,
"read_file(path, bufs, direct, expected, verify=-1) -> (status, value, digest, file_id)\n\n"
"Open `path` (O_RDONLY|O_CLOEXEC|O_NONBLOCK, plus O_DIRECT if `direct`; again without it if\n"
"O_DIRECT is refused with EINVAL, as for a FIFO or a directory), fstat it and, when it\n"
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

static PyObject *read_file(PyObject *self, PyObject *args) { return single(args, 0); }

/* The batch functions: parse every job (GIL held), run them all in order in one GIL release,
 * then build a list of outcomes. `kind` selects writes (1) or reads (0). */
/* The exception set now, raised again as its type with "jobs[i]: " before its message (a
 * batch's argument error names the job it is about). */
static void name_job(Py_ssize_t i) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    PyErr_Format(type, "jobs[%zd]: %S", i, value);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(traceback);
}

/* `named`: argument errors say "jobs[i]: " (write_files/read_files, not a single call). */
static PyObject *run_batch(PyObject *jobs_arg, int kind, int named) {
    /* a tuple of the jobs, owned here: the caller's list may change while the GIL is released
     * (or while a job's arguments are converted), and the argument tuples it holds keep the
     * objects each job borrows (its path, for errors) alive */
    PyObject *fast = PySequence_Tuple(jobs_arg);
    if (fast == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(fast);
    size_t size = kind ? sizeof(struct write_job) : sizeof(struct read_job);
    char *jobs = PyMem_Calloc(n ? (size_t)n : 1, size);
    PyObject *result = NULL;
    Py_ssize_t parsed = 0;
    if (jobs == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    for (; parsed < n; parsed++) {
        PyObject *item = PyTuple_GET_ITEM(fast, parsed);
        if (!PyTuple_Check(item)) {
            PyErr_Format(PyExc_TypeError, "jobs[%zd]: an argument tuple, not %.80s", parsed,
                         Py_TYPE(item)->tp_name);
            goto out;
        }
        int rc = kind ? write_job_parse(item, (struct write_job *)(jobs + parsed * size))
                      : read_job_parse(item, (struct read_job *)(jobs + parsed * size));
        if (rc < 0) {
            if (named) name_job(parsed);
            goto out;
        }
    }
    xxh128_fn hash = hasher;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        if (kind)
            write_job_run((struct write_job *)(jobs + i * size));
        else
            read_job_run((struct read_job *)(jobs + i * size), hash);
    }
    Py_END_ALLOW_THREADS
    result = PyList_New(n);
    for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
        PyObject *outcome = kind ? write_job_outcome((struct write_job *)(jobs + i * size))
                                 : read_job_outcome((struct read_job *)(jobs + i * size));
        if (outcome == NULL) {
            Py_CLEAR(result);
            break;
        }
        PyList_SET_ITEM(result, i, outcome);
    }
out:
    for (Py_ssize_t i = 0; jobs != NULL && i < parsed; i++) {
        if (kind)
            write_job_release((struct write_job *)(jobs + i * size));
        else
            read_job_release((struct read_job *)(jobs + i * size));
    }
    PyMem_Free(jobs);
    Py_DECREF(fast);
    return result;
}

/* `write_file` / `read_file`: a batch of one job, whose OSError is raised. */
static PyObject *single(PyObject *args, int kind) {
    PyObject *jobs = PyTuple_Pack(1, args);
    if (jobs == NULL) return NULL;
    PyObject *outcomes = run_batch(jobs, kind, 0);
    Py_DECREF(jobs);
    if (outcomes == NULL) return NULL;
    PyObject *outcome = PyList_GET_ITEM(outcomes, 0);
    Py_INCREF(outcome);
    Py_DECREF(outcomes);
    if (PyExceptionInstance_Check(outcome)) {
        PyErr_SetObject((PyObject *)Py_TYPE(outcome), outcome);
        Py_DECREF(outcome);
        return NULL;
    }
    return outcome;
}

PyDoc_STRVAR(write_files_doc,
"write_files(jobs) -> list[bool | OSError]\n\n"
"`write_file(*args)` for every argument tuple in `jobs`, in order, with the GIL released once\n"
"for all of them: one outcome per job, True/False as `write_file` returns, or the OSError it\n"
"would raise (returned, not raised: the other jobs still run).\n\n"
"Raises:\n"
"    TypeError, ValueError, BufferError: a job's arguments are refused as `write_file` refuses\n"
"        them; then no job runs.");

static PyObject *write_files(PyObject *self, PyObject *jobs) { return run_batch(jobs, 1, 1); }

PyDoc_STRVAR(read_files_doc,
"read_files(jobs) -> list[tuple | OSError]\n\n"
"`read_file(*args)` for every argument tuple in `jobs`, in order, with the GIL released once\n"
"for all of them: one outcome per job, the tuple `read_file` returns, or the OSError it would\n"
"raise (returned, not raised: the other jobs still run).\n\n"
"Raises:\n"
"    TypeError, ValueError: a job's arguments are refused as `read_file` refuses them; then no\n"
"        job runs.");

static PyObject *read_files(PyObject *self, PyObject *jobs) { return run_batch(jobs, 0, 1); }

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
    {"write_files", write_files, METH_O, write_files_doc},
    {"read_files", read_files, METH_O, read_files_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_chunkio",
    "Chunk files written or read in one GIL-free call each (see fileio.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__chunkio(void) { return PyModule_Create(&module); }
