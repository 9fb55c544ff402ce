/* The signal hold of a donated call and the exception plumbing of treemode's
 * extension (declarations: _guard.h). */
#include <signal.h> /* raise: delivering held signals */

#include "_guard.h"

/* The signal hold of a donated call (treemode._pipeline._interrupts, whose
 * objects `configure` hands over): once the executable consumed the donated
 * buffers, the new values are the only whole state until written, so every
 * Python signal handler is swapped for a deferring one from before the call
 * to after the write. Made here in the common case only: the main thread, no
 * hold open, nothing deferred, and the handler table the one the Python hold
 * last planned its swaps for (`hold_plan`: [handlers, swaps]); anything else is
 * a miss, and the Python pipeline holds. */
static PyObject *
planned_swaps(void)
{
    if (PyList_GET_SIZE(tm_hold_plan) != TM_PLAN_SIZE)
        return NULL;
    PyObject *handlers = PyList_GET_ITEM(tm_hold_plan, TM_PLAN_HANDLERS);
    PyObject *swaps = PyList_GET_ITEM(tm_hold_plan, TM_PLAN_SWAPS);
    Py_ssize_t n = PyTuple_GET_SIZE(tm_signals);
    if (!PyTuple_Check(handlers) || !PyTuple_Check(swaps) || PyTuple_GET_SIZE(handlers) != n)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *handler = PyObject_CallOneArg(tm_getsignal, PyTuple_GET_ITEM(tm_signals, i));
        if (handler == NULL)
            return NULL;
        Py_DECREF(handler); /* only compared; the signal module holds it */
        if (handler != PyTuple_GET_ITEM(handlers, i))
            return NULL;
    }
    return Py_NewRef(swaps);
}

/* The token (the swaps made, a new reference), None outside the main thread,
 * NULL with an exception (a pending signal's handler raised: nothing consumed
 * yet), or NULL without one: a miss. */
PyObject *
tm_hold_signals(PyObject *donated)
{
    if (PyThread_get_thread_ident() != tm_main_thread)
        Py_RETURN_NONE;
    if (PyList_GET_SIZE(tm_hold_open) != 0 || PyList_GET_SIZE(tm_hold_deferred) != 0)
        return NULL;
    PyObject *swaps = planned_swaps();
    if (swaps == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(swaps); i++) {
        PyObject *swap = PyTuple_GET_ITEM(swaps, i); /* (signum, original, deferring) */
        PyObject *args[2] = {PyTuple_GET_ITEM(swap, TM_SWAP_SIGNUM),
                             PyTuple_GET_ITEM(swap, TM_SWAP_DEFERRING)};
        PyObject *old = PyObject_Vectorcall(tm_setsignal, args, 2, NULL);
        if (old == NULL) {
            Py_DECREF(swaps);
            return NULL;
        }
        Py_DECREF(old);
    }
    if (PyList_Append(tm_hold_open, donated) < 0) {
        Py_DECREF(swaps);
        return NULL;
    }
    return swaps;
}

/* Sends the held signals again, the original handlers back: their handlers
 * run here, in the interpreter's order, the first exception raised. */
static int
deliver_deferred(void)
{
    Py_ssize_t n = PyList_GET_SIZE(tm_hold_deferred);
    PyObject *deferred = PyList_GetSlice(tm_hold_deferred, 0, n);
    if (deferred == NULL || PyList_SetSlice(tm_hold_deferred, 0, n, NULL) < 0) {
        Py_XDECREF(deferred);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long signum = PyLong_AsLong(PyList_GET_ITEM(deferred, i));
        if (signum > 0)
            raise((int)signum); /* marks the handler as due (the main thread's) */
    }
    Py_DECREF(deferred);
    PyErr_Clear();
    return PyErr_CheckSignals();
}

/* The exception set, fetched as one normalized object with its traceback. */
PyObject *
tm_fetch_error(void)
{
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    if (traceback != NULL && value != NULL)
        PyException_SetTraceback(value, traceback);
    Py_XDECREF(type);
    Py_XDECREF(traceback);
    return value;
}

/* Raises `error` (stolen) again, with its traceback. */
void
tm_restore_error(PyObject *error)
{
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(error)), error, PyException_GetTraceback(error));
}

/* The exception set now gets `context` (stolen) as its context. */
void
tm_chain(PyObject *context)
{
    PyObject *raised = tm_fetch_error();
    PyException_SetContext(raised, context);
    tm_restore_error(raised);
}

/* Ends the hold `token` (stolen; None: there was none): the original handlers
 * back, then the held signals delivered. An exception already set stays the
 * one raised, unless a handler raises: that one is raised, with the first as
 * its context. Returns -1 when an exception is set after. */
int
tm_release_signals(PyObject *token)
{
    PyObject *pending = PyErr_Occurred() ? tm_fetch_error() : NULL;
    int released = 0;
    if (token != Py_None) {
        Py_ssize_t n = PyList_GET_SIZE(tm_hold_open);
        released = n > 0 ? PyList_SetSlice(tm_hold_open, n - 1, n, NULL) : -1; /* close */
        for (Py_ssize_t i = 0; released == 0 && i < PyTuple_GET_SIZE(token); i++) {
            PyObject *swap = PyTuple_GET_ITEM(token, i);
            PyObject *args[2] = {PyTuple_GET_ITEM(swap, TM_SWAP_SIGNUM),
                                 PyTuple_GET_ITEM(swap, TM_SWAP_ORIGINAL)};
            PyObject *old = PyObject_Vectorcall(tm_setsignal, args, 2, NULL);
            released = old == NULL ? -1 : 0; /* a new signal's handler raised */
            Py_XDECREF(old);
        }
        if (released == 0 && PyList_GET_SIZE(tm_hold_deferred) != 0)
            released = deliver_deferred();
    }
    Py_DECREF(token);
    if (released == 0) {
        if (pending != NULL)
            tm_restore_error(pending);
        return pending == NULL ? 0 : -1;
    }
    if (pending != NULL)
        tm_chain(pending);
    return -1;
}

