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
 * same bits with or without the pool, however the chunks fall. One product at a time: a caller that finds the pool
 * busy (another thread's product) runs its product without it. */
#define POOL_MAX 16
/* A product is cut into chunks of its units, taken one at a time by whichever thread is free
 * (the caller too): a thread that loses its core to another process or to the event loop
 * delays the product by the chunk it holds, not by a fixed share of it. The chunks of the
 * product in hand, its ticket and the next chunk to take are one 64-bit word (`work`), so a
 * worker that comes late to a product can never take a chunk of the next one. */
#define POOL_CHUNKS 8               /* chunks a product per thread, at most */
#define W_TICKET(w) ((unsigned)((w) >> 40))
#define W_CHUNKS(w) ((int)(((w) >> 20) & 0xfffff))
#define W_NEXT(w) ((int)((w) & 0xfffff))
static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int workers;                    /* started, fixed at the first activation */
    atomic_int active;
    atomic_flag busy;
    _Atomic unsigned long long work;   /* ticket (24 bits), chunks (20), next chunk (20) */
    atomic_int done;                /* chunks of the product in hand finished */
    unsigned ticket;                /* the last product's ticket (written by the poster only) */
    unsigned first;                 /* the ticket when the workers were started */
    job_t job;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, ATOMIC_FLAG_INIT, 0, 0, 0, 0, {0}};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Take the next chunk of product `ticket`: its index and, in *chunks, how many it has; -1
 * when none is left or the product is another. */
static int pool_claim(unsigned ticket, int *chunks) {
    unsigned long long w = atomic_load_explicit(&pool.work, memory_order_acquire);
    for (;;) {
        if (W_TICKET(w) != ticket || W_NEXT(w) >= W_CHUNKS(w)) return -1;
        if (atomic_compare_exchange_weak_explicit(&pool.work, &w, w + 1, memory_order_acq_rel,
                                                  memory_order_acquire)) {
            *chunks = W_CHUNKS(w);
            return W_NEXT(w);
        }
    }
}

/* Run chunks of product `ticket` (units [job->n0, job->n1)) until none is left. */
static void pool_run(const job_t *job, unsigned ticket) {
    const int n0 = job->n0, span = job->n1 - job->n0;
    int chunks = 1;
    for (int c; (c = pool_claim(ticket, &chunks)) >= 0;) {
        job_t part = *job;
        part.n0 = n0 + (int)((long)span * c / chunks);
        part.n1 = n0 + (int)((long)span * (c + 1) / chunks);
        if (part.n0 < part.n1) run_rows(&part);
        atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
    }
}

static void *pool_worker(void *arg) {
    (void)arg;
    unsigned seen = pool.first;     /* not the ticket now: a product may be posted before we run */
    for (;;) {
        unsigned spins = 0, t;
        while ((t = W_TICKET(atomic_load_explicit(&pool.work, memory_order_acquire))) == seen) {
            if (!atomic_load_explicit(&pool.active, memory_order_relaxed)) {
                pthread_mutex_lock(&pool.mu);
                while (!atomic_load(&pool.active) && W_TICKET(atomic_load(&pool.work)) == seen)
                    pthread_cond_wait(&pool.cv, &pool.mu);
                pthread_mutex_unlock(&pool.mu);
                continue;
            }
            cpu_relax();
            if ((++spins & 1023) == 0) sched_yield();
        }
        seen = t;
        /* read after the ticket: while product t has a chunk to take, its job stays as posted
         * (a copy made once it is over is never run: every claim on it fails) */
        job_t j = pool.job;
        pool_run(&j, t);
    }
    return NULL;
}

/* Post `job` (units [0, job->n1)) to the workers, take chunks of it here too, and return when
 * every chunk is done. The caller holds `busy`. */
static void pool_product(job_t *job) {
    const int units = job->n1, parts = pool.workers + 1;
    int chunks = units < POOL_CHUNKS * parts ? units : POOL_CHUNKS * parts;
    if (chunks < 1) chunks = 1;
    pool.job = *job;
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
    pool.ticket = (pool.ticket + 1) & 0xffffff;
    atomic_store_explicit(&pool.work, ((unsigned long long)pool.ticket << 40) | ((unsigned long long)chunks << 20),
                          memory_order_release);
    pool_run(job, pool.ticket);
    /* the chunks the workers hold: spin for them, yielding now and then (a worker that lost its
     * core to another thread would otherwise have this one spin for a whole time slice) */
    for (unsigned spins = 1; atomic_load_explicit(&pool.done, memory_order_acquire) < chunks; spins++) {
        cpu_relax();
        if ((spins & 1023) == 0) sched_yield();
    }
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
        pool.first = pool.ticket;           /* steady: nothing is posted while inactive */
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
