/* The step pool of the quantized kernels (actorserve.engine.kernels.quant.StepPool): included by
 * qgemv.c after `job_t` and `run_rows`, which it hands to its worker threads. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>

/* The step pool: worker threads that, while a decode step runs (`qpool_active(1)` ...
 * `qpool_active(0)`, from the engine), spin waiting for the next product and take their share
 * of its rows as soon as it is posted: a hand-off of about a microsecond, where waking a
 * sleeping OpenMP thread for each of a step's ~120 small products cost more than it saved
 * (so, without the pool, small products run on one thread: `quant.PARALLEL_MIN`). Between
 * steps the workers sleep on a condition variable, so the cores are free for the server's
 * event loop; while spinning they yield now and then to any other thread that wants the core.
 * Each output row is computed by exactly one thread with the same code, so the result is the
 * same bits with or without the pool. One product at a time: a caller that finds the pool
 * busy (another thread's product) runs its product without it. */
#define POOL_MAX 16
static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int workers;                    /* started, fixed at the first activation */
    atomic_int active;
    atomic_flag busy;
    atomic_uint posted;             /* ticket of the last product posted */
    atomic_int remaining;           /* workers still on it */
    unsigned first;                 /* `posted` when the workers were started */
    job_t job;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, ATOMIC_FLAG_INIT, 0, 0, 0, {0}};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void *pool_worker(void *arg) {
    const int me = (int)(intptr_t)arg, parts = pool.workers + 1;
    unsigned seen = pool.first;     /* not `posted` now: a product may be posted before we run */
    for (;;) {
        unsigned spins = 0;
        while (atomic_load_explicit(&pool.posted, memory_order_acquire) == seen) {
            if (!atomic_load_explicit(&pool.active, memory_order_relaxed)) {
                pthread_mutex_lock(&pool.mu);
                while (!atomic_load(&pool.active) && atomic_load(&pool.posted) == seen)
                    pthread_cond_wait(&pool.cv, &pool.mu);
                pthread_mutex_unlock(&pool.mu);
                continue;
            }
            cpu_relax();
            if ((++spins & 1023) == 0) sched_yield();
        }
        seen = atomic_load_explicit(&pool.posted, memory_order_acquire);
        job_t j = pool.job;
        int n0 = j.n0, span = j.n1 - j.n0;
        j.n0 = n0 + (int)((long)span * me / parts);
        j.n1 = n0 + (int)((long)span * (me + 1) / parts);
        run_rows(&j);
        atomic_fetch_sub_explicit(&pool.remaining, 1, memory_order_release);
    }
    return NULL;
}

static void pool_forget(void) {     /* in a forked child: the workers were not copied */
    pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
    pool.mu = mu;
    pool.cv = cv;
    pool.workers = 0;
    atomic_store(&pool.active, 0);
    atomic_flag_clear(&pool.busy);
}

/* Start (on = 1, with `workers` threads the first time) or stop a step's spinning. Returns the
 * number of workers running, 0 when none could be started. */
int qpool_active(int on, int workers) {
    static int atfork;
    pthread_mutex_lock(&pool.mu);
    if (on && pool.workers == 0 && workers > 0) {
        if (!atfork) { pthread_atfork(NULL, NULL, pool_forget); atfork = 1; }
        if (workers > POOL_MAX) workers = POOL_MAX;
        int started = 0;
        pool.workers = workers;                 /* read by each worker as it starts */
        pool.first = atomic_load(&pool.posted); /* steady: nothing is posted while inactive */
        for (int i = 0; i < workers; i++) {
            pthread_t t;
            pthread_attr_t attr;
            pthread_attr_init(&attr);
            pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
            if (pthread_create(&t, &attr, pool_worker, (void *)(intptr_t)(i + 1)) == 0) started++;
            pthread_attr_destroy(&attr);
            if (started != i + 1) break;
        }
        if (started != workers) {       /* cannot happen in practice; never post to a short pool */
            pool.workers = -1;
        }
    }
    while (atomic_flag_test_and_set_explicit(&pool.busy, memory_order_acquire))
        cpu_relax();                    /* no product in flight while `active` changes */
    atomic_store(&pool.active, on && pool.workers > 0);
    atomic_flag_clear_explicit(&pool.busy, memory_order_release);
    pthread_cond_broadcast(&pool.cv);
    int n = pool.workers > 0 ? pool.workers : 0;
    pthread_mutex_unlock(&pool.mu);
    return n;
}
