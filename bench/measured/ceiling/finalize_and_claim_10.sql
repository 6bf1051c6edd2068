WITH finalized AS 
(UPDATE jobs SET status=CASE WHEN ((outcome.status = :status_1::VARCHAR OR outcome.status = :status_2::VARCHAR) AND jobs.cancel_requested_at IS NOT NULL) THEN :param_1::VARCHAR ELSE outcome.status END, run_at=CASE WHEN (outcome.delay IS NULL) THEN jobs.run_at ELSE now() + make_interval(:make_interval_1::INTEGER, :make_interval_2::INTEGER, :make_interval_3::INTEGER, :make_interval_4::INTEGER, :make_interval_5::INTEGER, :make_interval_6::INTEGER, outcome.delay) END, attempts=(jobs.attempts - outcome.refund), locked_by=NULL::VARCHAR, locked_at=NULL::TIMESTAMP WITH TIME ZONE, last_error=CASE WHEN (outcome.status = :status_3::VARCHAR) THEN jobs.last_error ELSE coalesce(left(outcome.error, :left_1::INTEGER), jobs.last_error) END, finished_at=CASE WHEN (outcome.status = :status_4::VARCHAR) THEN now() WHEN (outcome.status = :status_5::VARCHAR) THEN now() WHEN (CASE WHEN ((outcome.status = :status_1::VARCHAR OR outcome.status = :status_2::VARCHAR) AND jobs.cancel_requested_at IS NOT NULL) THEN :param_1::VARCHAR ELSE outcome.status END = :param_4::VARCHAR) THEN now() END, result=CASE WHEN (outcome.status = :status_6::VARCHAR) THEN CAST(outcome.result AS JSONB) ELSE jobs.result END FROM unnest(:ids::BIGINT[], :versions::BIGINT[], :statuses::TEXT[], :delays::FLOAT[], :errors::TEXT[], :refunds::INTEGER[], :results::TEXT[]) AS outcome(id, version, status, delay, error, refund, result) WHERE jobs.id = ANY (CAST((SELECT :ids::BIGINT[] AS anon_1) AS BIGINT[])) AND jobs.id = outcome.id AND jobs.lease_version = outcome.version AND jobs.status = (SELECT 'running') RETURNING jobs.id), 
picked AS MATERIALIZED 
(SELECT jobs.id AS id 
FROM jobs 
WHERE jobs.status = 'queued' AND jobs.run_at <= now() AND jobs.queue = :queue_name::VARCHAR ORDER BY jobs.priority DESC, jobs.run_at, jobs.id 
 LIMIT 10 FOR NO KEY UPDATE SKIP LOCKED), 
claimed AS 
(UPDATE jobs SET status='running', attempts=(jobs.attempts + :attempts_1::INTEGER), locked_by=:owner::VARCHAR, locked_at=clock_timestamp(), lease_version=(jobs.lease_version + :lease_version_1::BIGINT) WHERE jobs.id = ANY (array((SELECT picked.id 
FROM picked))) RETURNING jobs.id, jobs.lease_version, jobs.attempts, jobs.max_attempts, jobs.task, jobs.queue, CAST(jobs.payload AS TEXT) AS payload, jobs.priority, jobs.created_at, jobs.headers, jobs.run_at, CAST(EXTRACT(epoch FROM now() - jobs.created_at) AS FLOAT) AS age), result AS (SELECT 'f' AS k, finalized.id, CAST(NULL AS BIGINT) AS lease_version, CAST(NULL AS INTEGER) AS attempts, CAST(NULL AS INTEGER) AS max_attempts, CAST(NULL AS TEXT) AS task, CAST(NULL AS TEXT) AS queue, CAST(NULL AS TEXT) AS payload, CAST(NULL AS INTEGER) AS priority, CAST(NULL AS TIMESTAMP WITH TIME ZONE) AS created_at, CAST(NULL AS JSONB) AS headers, CAST(NULL AS TIMESTAMP WITH TIME ZONE) AS run_at, CAST(NULL AS FLOAT) AS age 
FROM finalized UNION ALL SELECT 'c' AS k, claimed.id, claimed.lease_version, claimed.attempts, claimed.max_attempts, claimed.task, claimed.queue, claimed.payload, claimed.priority, claimed.created_at, claimed.headers, claimed.run_at, claimed.age 
FROM claimed)
SELECT coalesce(array_agg(id) FILTER (WHERE k = 'c'), '{}') AS ids,
       coalesce(array_agg(lease_version) FILTER (WHERE k = 'c'), '{}') AS versions,
       coalesce(array_agg('done'::text) FILTER (WHERE k = 'c'), '{}') AS statuses,
       coalesce(array_agg(NULL::float8) FILTER (WHERE k = 'c'), '{}') AS delays,
       coalesce(array_agg(NULL::text) FILTER (WHERE k = 'c'), '{}') AS errors,
       coalesce(array_agg(0) FILTER (WHERE k = 'c'), '{}') AS refunds,
       coalesce(array_agg(NULL::text) FILTER (WHERE k = 'c'), '{}') AS results
  FROM result
\gset
