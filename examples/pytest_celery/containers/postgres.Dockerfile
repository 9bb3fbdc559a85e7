# A PostgreSQL 15 server for pytest-celery's container mode, from the Debian rootfs
# image that build.sh makes (no registry: `docker build` finds the base locally).
FROM pgqueue/bookworm:base
ENV PATH=/usr/lib/postgresql/15/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PGDATA=/var/lib/postgresql/pgqueue
USER postgres
# trust from anywhere: a throwaway test server on the test's own bridge network
RUN initdb -U postgres --auth=trust --encoding=UTF8 --locale=C --no-sync \
 && echo "listen_addresses = '*'" >> "$PGDATA/postgresql.conf" \
 && echo "unix_socket_directories = '/tmp'" >> "$PGDATA/postgresql.conf" \
 && echo "host all all 0.0.0.0/0 trust" >> "$PGDATA/pg_hba.conf"
EXPOSE 5432
STOPSIGNAL SIGINT
CMD ["postgres"]
