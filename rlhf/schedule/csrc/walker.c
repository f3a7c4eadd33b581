/* The schedule search's inner loop in C: the event walk of rlhf/schedule/simulate.py over a schedule that
 * the annealer edits one stage at a time (rlhf.schedule.simulate.Walker is the Python original; both compute
 * every end time with the same double additions and maxima, so they agree to the bit).
 *
 *   Walker(pred, lag, dur, mem, stage, queue, partner, orders)
 *                                    the problem's subtask arrays (rlhf.schedule.problem.NodeArrays) and a
 *                                    start schedule (lists of ids per stage); simulates it: .ok, .makespan,
 *                                    .end[v] = w[v] = end of v
 *   w.trial(s, new_order, cut)       the schedule with stage s replaced, re-simulated from the subtasks that
 *                                    started at or after `cut` in the current one; returns (makespan, mean
 *                                    end of the stages' last subtasks), makespan inf on a deadlock
 *   w.accept()                       the last trial becomes the current schedule
 *   w.critical_edges(seed)           simulate.critical_edges of the current schedule
 *   w.peak(order)                    simulate.order_peak of a stage order
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    PyObject_HEAD
    Py_ssize_t n, stages;
    long *pred, *stage, *queue, *partner;
    double *lag, *dur, *mem;
    Py_ssize_t *pos;        /* pos[v]: the place of v in its stage's current order */
    Py_ssize_t *off;        /* stage s holds order[off[s]] .. order[off[s + 1] - 1] */
    long *order;            /* the current per-stage orders, flat */
    long *trial_order;      /* the last trial's order of trial_stage */
    Py_ssize_t trial_stage; /* -1 before any trial */
    double *ends[2];        /* ends[cur]: the current schedule's end times; the other one: the last trial's */
    int cur;
    long *waker;            /* waker[p]: the stage waiting for p to end, -1 if none */
    Py_ssize_t *ptr;        /* per stage: the next position to run */
    double *free_at;        /* per stage: when it is free */
    long *todo;             /* stages to resume (a stack) */
    double makespan, trial_makespan;
    int ok;
} Walker;

static const long *stage_order(Walker *w, Py_ssize_t s, int trial) {
    return (trial && s == w->trial_stage) ? w->trial_order : w->order + w->off[s];
}

/* Runs every stage from ptr/free_at until it waits on an unfinished predecessor; returns the makespan, or
 * inf if some stage never finishes (a cyclic wait). */
static double walk(Walker *w, double *end, int trial) {
    Py_ssize_t top = 0;
    for (Py_ssize_t v = 0; v < w->n; v++) w->waker[v] = -1;
    for (Py_ssize_t s = 0; s < w->stages; s++) w->todo[top++] = (long)s;
    while (top > 0) {
        long s = w->todo[--top];
        const long *o = stage_order(w, s, trial);
        Py_ssize_t k = w->ptr[s], len = w->off[s + 1] - w->off[s];
        double t = w->free_at[s];
        while (k < len) {
            long v = o[k], p = w->pred[v];
            if (p >= 0) {
                double e = end[p];
                if (e < 0.0) {
                    w->waker[p] = s;
                    break;
                }
                e += w->lag[v];
                if (e > t) t = e;
            }
            t += w->dur[v];
            end[v] = t;
            k++;
            long waiting = w->waker[v];
            if (waiting >= 0) w->todo[top++] = waiting;
        }
        w->ptr[s] = k;
        w->free_at[s] = t;
    }
    double makespan = 0.0;
    for (Py_ssize_t s = 0; s < w->stages; s++) {
        if (w->ptr[s] < w->off[s + 1] - w->off[s]) return INFINITY;
        if (w->free_at[s] > makespan) makespan = w->free_at[s];
    }
    return makespan;
}

static int read_ids(PyObject *list, long *out, Py_ssize_t len, Py_ssize_t n, const char *what) {
    if (!PyList_Check(list) || PyList_GET_SIZE(list) != len) {
        PyErr_Format(PyExc_ValueError, "Walker: %s must be a list of %zd subtask ids", what, len);
        return -1;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        long v = PyLong_AsLong(PyList_GET_ITEM(list, i));
        if (v == -1 && PyErr_Occurred()) return -1;
        if (v < 0 || v >= n) {
            PyErr_Format(PyExc_ValueError, "Walker: %s holds id %ld, not a subtask (0..%zd)", what, v, n - 1);
            return -1;
        }
        out[i] = v;
    }
    return 0;
}

static int read_longs(PyObject *list, long *out, Py_ssize_t n, long lo, long hi, const char *what) {
    if (!PyList_Check(list) || PyList_GET_SIZE(list) != n) {
        PyErr_Format(PyExc_ValueError, "Walker: %s must be a list of %zd integers", what, n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = PyLong_AsLong(PyList_GET_ITEM(list, i));
        if (out[i] == -1 && PyErr_Occurred()) return -1;
        if (out[i] < lo || out[i] > hi) {
            PyErr_Format(PyExc_ValueError, "Walker: %s[%zd]=%ld is out of range [%ld, %ld]", what, i, out[i], lo, hi);
            return -1;
        }
    }
    return 0;
}

static int read_floats(PyObject *list, double *out, Py_ssize_t n, const char *what) {
    if (!PyList_Check(list) || PyList_GET_SIZE(list) != n) {
        PyErr_Format(PyExc_ValueError, "Walker: %s must be a list of %zd numbers", what, n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = PyFloat_AsDouble(PyList_GET_ITEM(list, i));
        if (out[i] == -1.0 && PyErr_Occurred()) return -1;
    }
    return 0;
}

static void walker_dealloc(Walker *w) {
    PyMem_Free(w->pred);
    PyMem_Free(w->stage);
    PyMem_Free(w->queue);
    PyMem_Free(w->partner);
    PyMem_Free(w->mem);
    PyMem_Free(w->pos);
    PyMem_Free(w->lag);
    PyMem_Free(w->dur);
    PyMem_Free(w->off);
    PyMem_Free(w->order);
    PyMem_Free(w->trial_order);
    PyMem_Free(w->ends[0]);
    PyMem_Free(w->ends[1]);
    PyMem_Free(w->waker);
    PyMem_Free(w->ptr);
    PyMem_Free(w->free_at);
    PyMem_Free(w->todo);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

static int walker_init(Walker *w, PyObject *args, PyObject *Py_UNUSED(kwds)) {
    PyObject *pred, *lag, *dur, *mem, *stage, *queue, *partner, *orders;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!O!O!", &PyList_Type, &pred, &PyList_Type, &lag, &PyList_Type, &dur,
                          &PyList_Type, &mem, &PyList_Type, &stage, &PyList_Type, &queue, &PyList_Type, &partner,
                          &PyList_Type, &orders))
        return -1;
    Py_ssize_t n = PyList_GET_SIZE(pred), stages = PyList_GET_SIZE(orders), longest = 0;
    w->n = n;
    w->stages = stages;
    w->trial_stage = -1;
    w->cur = 0;
    Py_ssize_t m = n ? n : 1;
    w->pred = PyMem_Calloc(m, sizeof(long));
    w->stage = PyMem_Calloc(m, sizeof(long));
    w->queue = PyMem_Calloc(m, sizeof(long));
    w->partner = PyMem_Calloc(m, sizeof(long));
    w->pos = PyMem_Calloc(m, sizeof(Py_ssize_t));
    w->lag = PyMem_Calloc(m, sizeof(double));
    w->dur = PyMem_Calloc(m, sizeof(double));
    w->mem = PyMem_Calloc(m, sizeof(double));
    w->off = PyMem_Calloc(stages + 1, sizeof(Py_ssize_t));
    w->order = PyMem_Calloc(n ? n : 1, sizeof(long));
    w->ends[0] = PyMem_Calloc(n ? n : 1, sizeof(double));
    w->ends[1] = PyMem_Calloc(n ? n : 1, sizeof(double));
    w->waker = PyMem_Calloc(n ? n : 1, sizeof(long));
    w->ptr = PyMem_Calloc(stages ? stages : 1, sizeof(Py_ssize_t));
    w->free_at = PyMem_Calloc(stages ? stages : 1, sizeof(double));
    w->todo = PyMem_Calloc(stages + n + 1, sizeof(long));
    if (!w->pred || !w->stage || !w->queue || !w->partner || !w->pos || !w->lag || !w->dur || !w->mem || !w->off ||
        !w->order || !w->ends[0] || !w->ends[1] || !w->waker || !w->ptr || !w->free_at || !w->todo) {
        PyErr_NoMemory();
        return -1;
    }
    if (read_longs(pred, w->pred, n, -1, (long)n - 1, "pred") ||
        read_longs(stage, w->stage, n, 0, (long)stages - 1, "stage") ||
        read_longs(queue, w->queue, n, 0, LONG_MAX, "queue") ||
        read_longs(partner, w->partner, n, 0, (long)n - 1, "partner") || read_floats(lag, w->lag, n, "lag") ||
        read_floats(dur, w->dur, n, "dur") || read_floats(mem, w->mem, n, "mem"))
        return -1;
    for (Py_ssize_t s = 0; s < stages; s++) {
        PyObject *o = PyList_GET_ITEM(orders, s);
        if (!PyList_Check(o)) {
            PyErr_SetString(PyExc_ValueError, "Walker: orders must be a list of lists of subtask ids");
            return -1;
        }
        Py_ssize_t len = PyList_GET_SIZE(o);
        w->off[s + 1] = w->off[s] + len;
        if (w->off[s + 1] > n) {
            PyErr_SetString(PyExc_ValueError, "Walker: the orders hold more subtasks than the problem");
            return -1;
        }
        if (read_ids(o, w->order + w->off[s], len, n, "a stage's order")) return -1;
        for (Py_ssize_t k = 0; k < len; k++) {
            long v = w->order[w->off[s] + k];
            if (w->stage[v] != s) {
                PyErr_Format(PyExc_ValueError, "Walker: subtask %ld is in the order of stage %zd, not its own %ld",
                             v, s, w->stage[v]);
                return -1;
            }
            w->pos[v] = k;
        }
        if (len > longest) longest = len;
    }
    if (w->off[stages] != n) {
        PyErr_Format(PyExc_ValueError, "Walker: the orders hold %zd subtasks, the problem %zd", w->off[stages], n);
        return -1;
    }
    w->trial_order = PyMem_Calloc(longest ? longest : 1, sizeof(long));
    if (!w->trial_order) {
        PyErr_NoMemory();
        return -1;
    }
    double *end = w->ends[0];
    for (Py_ssize_t v = 0; v < n; v++) end[v] = -1.0;
    for (Py_ssize_t s = 0; s < stages; s++) {
        w->ptr[s] = 0;
        w->free_at[s] = 0.0;
    }
    w->makespan = walk(w, end, 0);
    w->ok = isfinite(w->makespan);
    return 0;
}

static PyObject *walker_trial(Walker *w, PyObject *args) {
    Py_ssize_t s;
    PyObject *order;
    double cut;
    if (!PyArg_ParseTuple(args, "nO!d", &s, &PyList_Type, &order, &cut)) return NULL;
    if (s < 0 || s >= w->stages) return PyErr_Format(PyExc_IndexError, "Walker.trial: no stage %zd", s);
    if (read_ids(order, w->trial_order, w->off[s + 1] - w->off[s], w->n, "the new order")) return NULL;
    for (Py_ssize_t k = 0; k < w->off[s + 1] - w->off[s]; k++)
        if (w->stage[w->trial_order[k]] != s)
            return PyErr_Format(PyExc_ValueError, "Walker.trial: subtask %ld does not run on stage %zd",
                                w->trial_order[k], s);
    w->trial_stage = s;
    const double *base = w->ends[w->cur];
    double *end = w->ends[1 - w->cur];
    memcpy(end, base, (size_t)w->n * sizeof(double));
    for (Py_ssize_t t = 0; t < w->stages; t++) {
        /* the prefix that started before the cut is kept (simulate.simulate_from) */
        const long *o = stage_order(w, t, 1);
        Py_ssize_t lo = 0, hi = w->off[t + 1] - w->off[t];
        while (lo < hi) {
            Py_ssize_t mid = (lo + hi) / 2;
            long v = o[mid];
            if (base[v] - w->dur[v] < cut)
                lo = mid + 1;
            else
                hi = mid;
        }
        for (Py_ssize_t k = lo; k < w->off[t + 1] - w->off[t]; k++) end[o[k]] = -1.0;
        w->ptr[t] = lo;
        w->free_at[t] = lo ? end[o[lo - 1]] : 0.0;
    }
    w->trial_makespan = walk(w, end, 1);
    double finish = 0.0;
    Py_ssize_t used = 0;
    if (isfinite(w->trial_makespan)) {
        for (Py_ssize_t t = 0; t < w->stages; t++) {
            Py_ssize_t len = w->off[t + 1] - w->off[t];
            if (len) {
                finish += end[stage_order(w, t, 1)[len - 1]];
                used++;
            }
        }
    }
    return Py_BuildValue("dd", w->trial_makespan, used ? finish / (double)w->stages : 0.0);
}

static PyObject *walker_accept(Walker *w, PyObject *Py_UNUSED(ignored)) {
    if (w->trial_stage < 0 || !isfinite(w->trial_makespan)) {
        PyErr_SetString(PyExc_RuntimeError, "Walker.accept: no finished trial to accept");
        return NULL;
    }
    Py_ssize_t s = w->trial_stage, len = w->off[s + 1] - w->off[s];
    memcpy(w->order + w->off[s], w->trial_order, (size_t)len * sizeof(long));
    for (Py_ssize_t k = 0; k < len; k++) w->pos[w->trial_order[k]] = k;
    w->cur = 1 - w->cur;
    w->makespan = w->trial_makespan;
    w->trial_stage = -1;
    Py_RETURN_NONE;
}

/* splitmix64: the coin flips of critical_edges (simulate._splitmix) */
static uint64_t splitmix(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static PyObject *walker_critical_edges(Walker *w, PyObject *args) {
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "K", &seed)) return NULL;
    uint64_t state = (uint64_t)seed;
    const double *end = w->ends[w->cur];
    long v = -1;
    for (Py_ssize_t s = 0; s < w->stages; s++) {
        Py_ssize_t len = w->off[s + 1] - w->off[s];
        if (len && (v < 0 || end[w->order[w->off[s] + len - 1]] > end[v])) v = w->order[w->off[s] + len - 1];
    }
    PyObject *edges = PyList_New(0);
    if (!edges || v < 0) return edges;
    double eps = 1e-9 * (end[v] > 1.0 ? end[v] : 1.0);
    for (;;) {
        double start = end[v] - w->dur[v];
        if (start <= eps) break;
        long s = w->stage[v], p = w->pred[v];
        Py_ssize_t k = w->pos[v];
        int chain_binds = p >= 0 && end[p] + w->lag[v] >= start - eps;
        int stage_binds = k > 0 && end[w->order[w->off[s] + k - 1]] >= start - eps;
        if (stage_binds && chain_binds) stage_binds = (splitmix(&state) >> 63) == 1;
        if (stage_binds) {
            long u = w->order[w->off[s] + k - 1];
            if (w->queue[u] != w->queue[v] && w->partner[u] != v) {
                PyObject *edge = Py_BuildValue("(ln)", s, k);
                if (!edge || PyList_Append(edges, edge) < 0) {
                    Py_XDECREF(edge);
                    Py_DECREF(edges);
                    return NULL;
                }
                Py_DECREF(edge);
            }
            v = u;
        } else if (chain_binds) {
            v = p;
        } else {
            break;
        }
    }
    return edges;
}

static PyObject *walker_peak(Walker *w, PyObject *order) {
    if (!PyList_Check(order)) {
        PyErr_SetString(PyExc_TypeError, "Walker.peak: give a list of subtask ids");
        return NULL;
    }
    double live = 0.0, peak = 0.0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(order); i++) {
        long v = PyLong_AsLong(PyList_GET_ITEM(order, i));
        if (v == -1 && PyErr_Occurred()) return NULL;
        if (v < 0 || v >= w->n) return PyErr_Format(PyExc_ValueError, "Walker.peak: no subtask %ld", v);
        live += w->mem[v];
        if (live > peak) peak = live;
    }
    return PyFloat_FromDouble(peak);
}

static Py_ssize_t walker_len(Walker *w) { return w->n; }

static PyObject *walker_item(Walker *w, Py_ssize_t v) {
    if (v < 0 || v >= w->n) {
        PyErr_SetString(PyExc_IndexError, "Walker: no such subtask");
        return NULL;
    }
    return PyFloat_FromDouble(w->ends[w->cur][v]);
}

static PyObject *walker_get_makespan(Walker *w, void *Py_UNUSED(c)) { return PyFloat_FromDouble(w->makespan); }
static PyObject *walker_get_ok(Walker *w, void *Py_UNUSED(c)) { return PyBool_FromLong(w->ok); }

static PyObject *walker_get_end(Walker *w, void *Py_UNUSED(c)) {
    Py_INCREF(w);
    return (PyObject *)w;
}

static PyMethodDef walker_methods[] = {
    {"trial", (PyCFunction)walker_trial, METH_VARARGS,
     "trial(stage, new_order, cut) -> (makespan, mean stage finish) of the schedule with that stage replaced"},
    {"accept", (PyCFunction)walker_accept, METH_NOARGS, "accept() makes the last trial the current schedule"},
    {"critical_edges", (PyCFunction)walker_critical_edges, METH_VARARGS,
     "critical_edges(seed) -> [(stage, position), ...] on one critical path (simulate.critical_edges)"},
    {"peak", (PyCFunction)walker_peak, METH_O, "peak(order) -> the peak live memory over a stage order"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef walker_getset[] = {
    {"makespan", (getter)walker_get_makespan, NULL, "the current schedule's makespan (inf on a deadlock)", NULL},
    {"ok", (getter)walker_get_ok, NULL, "whether the start schedule finished (no deadlock)", NULL},
    {"end", (getter)walker_get_end, NULL, "the current end times, indexed by subtask id (the walker itself)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods walker_sequence = {
    .sq_length = (lenfunc)walker_len,
    .sq_item = (ssizeargfunc)walker_item,
};

static PyTypeObject WalkerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "rlhf_schedule_walker.Walker",
    .tp_basicsize = sizeof(Walker),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The event walk over a schedule edited one stage at a time (see the file's comment).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)walker_init,
    .tp_dealloc = (destructor)walker_dealloc,
    .tp_methods = walker_methods,
    .tp_getset = walker_getset,
    .tp_as_sequence = &walker_sequence,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "rlhf_schedule_walker", .m_size = -1};

PyMODINIT_FUNC PyInit_rlhf_schedule_walker(void) {
    if (PyType_Ready(&WalkerType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&WalkerType);
    if (PyModule_AddObject(m, "Walker", (PyObject *)&WalkerType) < 0) {
        Py_DECREF(&WalkerType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
